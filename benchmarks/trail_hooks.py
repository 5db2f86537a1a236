"""Time stamps along a request's path, for benchmarks/ttft_trail.py: the coordinator and the HTTP front-end run
with a few of their functions wrapped (here, at run time: the product carries no tracing), each wrapper noting
``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every process of the host) in a list that is written out
when the process exits.

    python -m benchmarks.trail_hooks coordinator TRAIL_FILE -- [launch.py's flags]
    python -m benchmarks.trail_hooks frontend TRAIL_FILE -- [python -m openai_server's flags]

The coordinator's front-end child is started through this module too (``frontend``, TRAIL_FILE.front). Each line
of a trail file is ``event key seconds``; the key is a request id, an HTTP request's ``x-trail-id`` header, a step id
or "-". Events, in a streamed HTTP request's order:

  f_bytes     the front-end's transport got bytes (uvicorn's data_received; key "-")
  f_app       the ASGI app is called (headers parsed)            f_route    the completions handler starts
  f_cpu       (at f_app) the front-end's CPU time so far, from which ttft_trail takes its CPU time per request
  f_sent      the Generate goes to the ZMQ socket               map        x-trail-id -> request id
  k_recv      the coordinator reads the frame                    k_decoded  ... decoded and checked
  k_tokenized the prompt is ready (add_admitted called)          k_admitted ... queued in the engine
  k_step      the engine's step begins (key "-")                 k_sent     a step goes to the workers (key: step id)
  k_result    a step's result is read back (key: step id)        k_reply    the first Delta goes to be sent
  f_delta     the front-end reads the first Delta                f_started  the route's wait for it returns
  f_resp      the event stream response is called               f_hdr      its headers go to uvicorn
  f_sse       the first event's bytes go to uvicorn
"""

from __future__ import annotations

import argparse
import atexit
import contextvars
import sys
import time

_events: list[tuple[str, str, float]] = []
_firsts: set[tuple[str, str]] = set()
TRAIL_ID: contextvars.ContextVar[str] = contextvars.ContextVar("trail_id", default="-")


def note(event: str, key: str, t: float | None = None) -> None:
    _events.append((event, key, time.perf_counter() if t is None else t))


def note_first(event: str, key: str, t: float | None = None) -> None:
    if (event, key) not in _firsts:
        _firsts.add((event, key))
        note(event, key, t)


def _dump(path: str) -> None:
    with open(path, "a") as f:
        f.writelines(f"{e} {k} {t:.9f}\n" for e, k, t in _events)


def _wrap(owner, name: str, before=None, after=None) -> None:
    """``owner.name`` calls ``before(*args)`` first and ``after(result, *args)`` last."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(owner, name, wrapped)


def hook_coordinator(trail: str) -> None:
    import coordinator.server_frames as frames
    import openai_server.child as child
    from coordinator.engine import Engine
    from coordinator.request_table import RequestTable
    from coordinator.server import Server
    from coordinator.worker_group import WorkerGroup

    rid_of: dict[str, str] = {}  # engine id -> client request id
    read_frame = frames.read_frame

    def traced_read_frame(frames_, secret):
        t0 = time.perf_counter()
        frame = read_frame(frames_, secret)
        rid = getattr(frame.request, "request_id", None)
        if rid is not None and type(frame.request).__name__ == "Generate":
            note("k_recv", rid, t0)
            note("k_decoded", rid)
        return frame

    frames.read_frame = traced_read_frame
    _wrap(RequestTable, "add", before=lambda self, identity, rid, eid, *a: rid_of.__setitem__(eid, rid))
    _wrap(
        Engine,
        "add_admitted",
        before=lambda self, ids, params, eid, *a: note("k_tokenized", rid_of.get(eid, eid)),
        after=lambda r, self, ids, params, eid, *a: note("k_admitted", rid_of.get(eid, eid)),
    )
    _wrap(Engine, "step", before=lambda self: note("k_step", "-"))
    _wrap(WorkerGroup, "send_step", after=lambda r, self, step: note("k_sent", str(step.step_id)))
    _wrap(WorkerGroup, "recv_result", after=lambda r, self, step_id: note("k_result", str(step_id)))
    # stamped before the send, which may wake the front-end on the other core and leave this process waiting
    _wrap(Server, "_reply", before=lambda self, req, out: note_first("k_reply", req.request_id))

    popen = child.subprocess.Popen

    def traced_popen(cmd, *args, **kwargs):  # the front-end child runs under this module too
        if isinstance(cmd, list) and cmd[1:3] == ["-m", "openai_server"]:
            cmd = [cmd[0], "-m", "benchmarks.trail_hooks", "frontend", trail + ".front", "--", *cmd[3:]]
        return popen(cmd, *args, **kwargs)

    child.subprocess.Popen = traced_popen


def hook_frontend() -> None:
    import client.async_client as ac
    import openai_server.__main__ as front
    import openai_server.app as app_module
    import openai_server.streaming as streaming

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        _wrap(HttpToolsProtocol, "data_received", before=lambda self, data: note("f_bytes", "-"))
    except ImportError:
        pass
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        _wrap(H11Protocol, "data_received", before=lambda self, data: note("f_bytes", "-"))
    except ImportError:
        pass
    build_app = front.build_app

    def traced_build_app(*args, **kwargs):
        app = build_app(*args, **kwargs)

        async def traced_app(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            tid = dict(scope["headers"]).get(b"x-trail-id", b"-").decode()
            note("f_app", tid)
            note("f_cpu", tid, time.process_time())  # the front-end's CPU seconds so far (not a time stamp)
            TRAIL_ID.set(tid)

            async def traced_send(message):
                if message.get("type") == "http.response.start":
                    note_first("f_hdr", tid)
                if message.get("body", b"").startswith(b"data: {"):
                    note_first("f_sse", tid)
                await send(message)

            await app(scope, receive, traced_send)

        return traced_app

    front.build_app = traced_build_app
    create_completion = app_module.create_completion

    def traced_completion(*args, **kwargs):
        note("f_route", TRAIL_ID.get())
        return create_completion(*args, **kwargs)

    app_module.create_completion = traced_completion
    start, call = streaming.ChoiceStreams.start, streaming.EventStreamResponse.__call__

    async def traced_start(self, *args, **kwargs):
        result = await start(self, *args, **kwargs)
        note("f_started", TRAIL_ID.get())
        return result

    async def traced_call(self, scope, receive, send):
        note("f_resp", TRAIL_ID.get())
        return await call(self, scope, receive, send)

    streaming.ChoiceStreams.start, streaming.EventStreamResponse.__call__ = traced_start, traced_call

    sent = [0.0]  # when the last frame went to the socket: stamped before the send, which may wake the coordinator
    # on the other core and leave this process waiting for the CPU before a stamp after it

    def after_open(result, self, msg):
        if type(msg).__name__ == "Generate":
            note("f_sent", TRAIL_ID.get(), sent[0])
            note("map", TRAIL_ID.get() + ":" + msg.request_id)

    _wrap(ac.AsyncClient, "_send_now", before=lambda self, data: sent.__setitem__(0, time.perf_counter()))
    _wrap(ac.AsyncClient, "_open", after=after_open)
    decode_reply = ac.decode_reply

    def traced_decode(data):
        t = time.perf_counter()
        msg, rid = decode_reply(data)
        if type(msg).__name__ == "Delta":
            note_first("f_delta", rid, t)
        return msg, rid

    ac.decode_reply = traced_decode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("role", choices=["coordinator", "frontend"], help="the process to run with the hooks in")
    p.add_argument("trail", help="the file its time stamps are written to at exit")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="--, then the process's own flags")
    a = p.parse_args()
    role, trail, rest = a.role, a.trail, a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    atexit.register(_dump, trail)
    if role == "coordinator":
        hook_coordinator(trail)
        from nanoserve.serve import main as serve_main

        return serve_main(rest)
    hook_frontend()
    import openai_server.__main__ as front

    return front.main(rest)


if __name__ == "__main__":
    sys.exit(main())
