"""Reading benchmarks/ttft_trail.py's trail files (written by benchmarks/trail_hooks.py): each request's time
stamps in path order, the p50 of each hop, the sums of spans per request (the front-end's own time, the ZMQ hop's)
and the front-end's CPU time per request."""

from __future__ import annotations

import os
import statistics
from collections import defaultdict


def read_trail(path: str) -> tuple[dict, dict]:
    """(by key: {event: first time}, by event: sorted times of keyless events and per step)."""
    keyed: dict[str, dict[str, float]] = defaultdict(dict)
    loose: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for name in (path, path + ".front"):
        if not os.path.exists(name):
            continue
        for line in open(name):
            event, key, t = line.split()
            if event == "map":
                tid, rid = key.split(":", 1)
                keyed[tid]["rid"] = rid
            elif key == "-" or event in ("k_sent", "k_result"):
                loose[event].append((float(t), key))
            else:
                keyed[key].setdefault(event, float(t))
    for v in loose.values():
        v.sort()
    return keyed, loose


def _after(loose: list, t: float, before: float | None = None) -> tuple[float, str] | None:
    for x in loose:
        if x[0] >= t and (before is None or x[0] <= before):
            return x
    return None


def _last_before(loose: list, t: float) -> float | None:
    best = None
    for x, _ in loose:
        if x <= t:
            best = x
    return best


def trail_of(keyed: dict, loose: dict, key: str, t_send: float, t_first: float) -> dict[str, float]:
    """One request's stamps in path order (those found), client send and receive included."""
    own = dict(keyed.get(key, {}))
    rid = own.pop("rid", key)
    k = keyed.get(rid, {})
    stamps = {"c_send": t_send}
    if "f_app" in own:
        b = _last_before([x for x in loose.get("f_bytes", []) if x[0] >= t_send], own["f_app"])
        if b is not None:
            stamps["f_bytes"] = b
        stamps.update({e: own[e] for e in ("f_app", "f_route", "f_sent") if e in own})
    stamps.update({e: k[e] for e in ("k_recv", "k_decoded", "k_tokenized", "k_admitted") if e in k})
    if "k_admitted" in k:
        step = _after(loose.get("k_step", []), k["k_admitted"])
        sent = _after(loose.get("k_sent", []), k["k_admitted"])
        if step:
            stamps["k_step"] = step[0]
        if sent:
            stamps["k_sent"] = sent[0]
            result = next((x for x in loose.get("k_result", []) if x[1] == sent[1]), None)
            if result:
                stamps["k_result"] = result[0]
    if "k_reply" in k:
        stamps["k_reply"] = k["k_reply"]
    if "f_delta" in keyed.get(rid, {}):
        stamps["f_delta"] = keyed[rid]["f_delta"]
    stamps.update({e: own[e] for e in ("f_started", "f_resp", "f_hdr") if e in own})
    if "f_sse" in own:
        stamps["f_sse"] = own["f_sse"]
    stamps["c_first"] = t_first
    return stamps


def hops(trails: list[dict[str, float]]) -> dict[str, float]:
    """p50 in ms of each hop between consecutive stamps (the order of the first trail)."""
    order = list(trails[0])
    out = {}
    for a, b in zip(order, order[1:]):
        xs = [t[b] - t[a] for t in trails if a in t and b in t]
        if xs:
            out[f"{a}->{b}"] = round(statistics.median(xs) * 1e3, 3)
    return out


def span_p50(trails: list[dict[str, float]], spans: tuple[tuple[str, str], ...]) -> float | None:
    """p50 in ms over requests of the sum of the spans (a, b): b - a, for trails that have every stamp."""
    xs = [sum(t[b] - t[a] for a, b in spans) for t in trails if all(a in t and b in t for a, b in spans)]
    return round(statistics.median(xs) * 1e3, 3) if xs else None


# the front-end's own time (before the Generate is sent, after the first Delta is read) and the coordinator hop both
# ways (zmq_hop: ZMQ, or the HTTP front-end's Unix socket)
OWN_SPANS = {
    "http": {"front_end_own": (("c_send", "f_sent"), ("f_delta", "c_first")), "zmq_hop": (("f_sent", "k_recv"),
             ("k_reply", "f_delta"))},
    "zmq": {"zmq_hop": (("c_send", "k_recv"), ("k_reply", "c_first"))},
}  # fmt: skip


def cpu_per_request(keyed: dict, keys: list[str]) -> float | None:
    """p50 in ms of the front-end's CPU time from one request's arrival to the next's (``keys``: the requests in
    the order sent, one at a time): its cost per request, which a loaded box's waits for the CPU do not inflate,
    but its idle wake-ups meanwhile (about 1% of a core on the CPU box) are in it: compare runs of like TTFTs."""
    cpu = [keyed.get(k, {}).get("f_cpu") for k in keys]
    xs = [b - a for a, b in zip(cpu, cpu[1:]) if a is not None and b is not None and b >= a]
    return round(statistics.median(xs) * 1e3, 3) if xs else None
