"""How fast real safetensors weights load, against the disk's own sequential read speed in the same run.

    python -m benchmarks.load_weights --shape qwen3-8b --device cuda [--runs auto,safetensors] [--tp 2] [--check]
    python -m benchmarks.load_weights --shape qwen3-0.6b --device cpu

Writes (once, cached: benchmarks/write_checkpoint.py) a random checkpoint of the shape, timing the write; evicts the
files from the page cache (fsync + POSIX_FADV_DONTNEED, no root needed) and reads them with ``dd bs=16M`` for the
disk's speed, then a second, warm ``dd`` of the first file to show the eviction took; then for each run evicts again
and times ``load_weights`` into a model already built on the device (the build is timed apart). A run is a reader
of model/loader.py (auto, staged, mmap, safetensors: safetensors' own, the reference) with optional
``:chunk=MB`` and ``:ahead=MB`` (model/weight_stream.py's CHUNK and READ_AHEAD). ``--tp N``: N processes, one per
rank (rank r on GPU r modulo the GPUs present), each reading only its shard, started together; the figure is the
checkpoint's bytes over the slowest rank's time. ``--check``: our first run's parameters equal, bit for bit, the
reference's. ``--probe-shape`` with ``--budget-s``: measure the disk on a small shape first and fall back to it when
the big one would not fit the time. ``dd`` runs again after the runs: a shared disk's speed drifts, so the runs are
compared with the mean of the two. The last lines are the table.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.write_checkpoint import Written, evict, write_checkpoint
from model import weight_stream
from model.checkpoint_plan import CheckpointPlan
from model.config import ModelConfig
from model.loader import build_model, checkpoint_files, load_weights, plan_pieces


@dataclass(slots=True)
class Row:
    run: str
    tp: str
    read_gb: float
    seconds: float
    gbps: float  # the checkpoint's bytes (all of them, at any tp) per second


def files_of(model_dir: Path) -> list[Path]:
    return checkpoint_files(model_dir)


def evict_all(files: list[Path]) -> None:
    for f in files:
        evict(f)


def dd_seconds(files: list[Path]) -> float:
    start = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return time.perf_counter() - start


def configure(run: str) -> str:
    """Apply a run's ``:chunk=MB`` / ``:ahead=MB`` to model/weight_stream.py; returns the reader name."""
    reader, *opts = run.split(":")
    weight_stream.CHUNK, weight_stream.READ_AHEAD = DEFAULTS
    for opt in opts:
        key, _, mb = opt.partition("=")
        value = int(float(mb) * (1 << 20))
        if key == "chunk":
            weight_stream.CHUNK = value
        elif key == "ahead":
            weight_stream.READ_AHEAD = value
        else:
            raise SystemExit(f"unknown run option {opt!r} in {run!r}: use chunk=MB or ahead=MB")
    return reader


DEFAULTS = (weight_stream.CHUNK, weight_stream.READ_AHEAD)
RANK_WAIT_S = 300.0  # a TP rank that has not built, loaded or answered by then has failed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_load(model, model_dir: Path, run: str, files: list[Path], device: torch.device) -> float:
    reader = configure(run)
    evict_all(files)
    sync(device)
    start = time.perf_counter()
    load_weights(model, model_dir, reader)
    sync(device)
    return time.perf_counter() - start


def planned_bytes(model, files: list[Path]) -> int:
    return sum(p.nbytes for p in plan_pieces(CheckpointPlan(model), files))


def same_bits(a, b) -> list[str]:
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p.view(torch.uint8), pb[n].view(torch.uint8))]


def rank_main(rank: int, tp: int, model_dir: str, run: str, device: str, dtype: str, barrier, results) -> None:
    from comm.parallel import set_tp

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        set_tp(rank, tp)
        model = build_model(ModelConfig.from_pretrained(model_dir), dev, getattr(torch, dtype))
        files = files_of(Path(model_dir))
        reader = configure(run)
        barrier.wait(RANK_WAIT_S)  # the parent evicts the page cache, then every rank starts at once
        barrier.wait(RANK_WAIT_S)
        sync(dev)
        start = time.perf_counter()
        load_weights(model, model_dir, reader)
        sync(dev)
        results.put((rank, planned_bytes(model, files), time.perf_counter() - start))
    except BaseException:
        barrier.abort()  # the parent and the other ranks stop waiting
        raise


def tp_rows(args, model_dir: Path, files: list[Path], total: int) -> list[Row]:
    import torch.multiprocessing as mp

    rows = []
    ctx = mp.get_context("spawn")
    for run in args.tp_runs.split(","):
        barrier, results = ctx.Barrier(args.tp + 1), ctx.Queue()
        procs = [
            ctx.Process(
                target=rank_main, args=(r, args.tp, str(model_dir), run, args.device, args.dtype, barrier, results)
            )
            for r in range(args.tp)
        ]
        for p in procs:
            p.start()
        try:
            barrier.wait(RANK_WAIT_S)  # every rank has built its model
            evict_all(files)
            barrier.wait(RANK_WAIT_S)
            got = sorted(results.get(timeout=RANK_WAIT_S) for _ in procs)
        except Exception as e:
            for p in procs:
                p.kill()
            raise SystemExit(f"a TP rank failed ({type(e).__name__}): see its traceback above") from None
        for p in procs:
            p.join()
        for rank, nbytes, seconds in got:
            rows.append(Row(f"{run} rank {rank}", f"{args.tp}", nbytes / 1e9, seconds, nbytes / seconds / 1e9))
        wall = max(s for _, _, s in got)
        rows.append(Row(f"{run} all ranks", f"{args.tp}", sum(n for _, n, _ in got) / 1e9, wall, total / wall / 1e9))
    return rows


def pick_shape(args) -> Written:
    """The checkpoint to measure: ``--shape``, or ``--probe-shape`` when the disk is too slow for the budget."""
    if not args.probe_shape:
        return write_checkpoint(args.shape, args.shard_gb)
    probe = write_checkpoint(args.probe_shape, args.shard_gb)
    files = files_of(probe.model_dir)
    evict_all(files)
    read_gbps = probe.nbytes / dd_seconds(files) / 1e9
    write_gbps = probe.nbytes / probe.seconds / 1e9 if probe.seconds else read_gbps / 2
    from benchmarks.shapes import SHAPES, model_stats

    stats = model_stats(SHAPES[args.shape])
    big = stats["total_params"] * stats["dtype_bytes"] / 1e9
    passes = 3 + len(args.runs.split(",")) + (len(args.tp_runs.split(",")) if args.tp > 1 else 0) + args.check
    estimate = big / write_gbps + passes * big / read_gbps
    print(
        f"probe {args.probe_shape}: write {write_gbps:.2f} GB/s, dd {read_gbps:.2f} GB/s; {args.shape} ({big:.1f} GB)"
    )
    print(f"  would take ~{estimate:.0f} s of a {args.budget_s:.0f} s budget (writing it once, {passes} reads)")
    if estimate > args.budget_s and not write_checkpoint_cached(args.shape, args.shard_gb):
        print(f"DISK TOO SLOW for {args.shape} in the budget: measuring {args.probe_shape} instead")
        return probe
    return write_checkpoint(args.shape, args.shard_gb)


def write_checkpoint_cached(name: str, shard_gb: float) -> bool:
    import json

    from benchmarks.write_checkpoint import checkpoint_dir

    marker = checkpoint_dir(name) / "nanoserve_checkpoint.json"
    return marker.is_file() and json.loads(marker.read_text()).get("layout", {}).get("shard_gb") == shard_gb


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--shape", default="qwen3-8b", help="the checkpoint's model shape (benchmarks/shapes.py)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="the checkpoint's file size (GB a shard)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="load into it")
    ap.add_argument("--dtype", default="bfloat16", help="the checkpoint's and the model's dtype")
    ap.add_argument("--runs", default="auto,safetensors", help="comma list of READER[:chunk=MB][:ahead=MB]")
    ap.add_argument("--tp", type=int, default=1, help="also load as each of N tensor-parallel ranks")
    ap.add_argument("--tp-runs", default="auto", help="the runs to repeat with --tp ranks")
    ap.add_argument("--check", action="store_true", help="our first run equals the reference, bit for bit")
    ap.add_argument("--probe-shape", default="", help="time the disk on this smaller shape first; fall back to it")
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds the --shape write and loads may take")
    args = ap.parse_args()

    w = pick_shape(args)
    files = files_of(w.model_dir)
    total = sum(f.stat().st_size for f in files)
    written = f"written at {w.nbytes / w.seconds / 1e9:.2f} GB/s in {w.seconds:.1f} s" if w.seconds else "cached"
    print(f"checkpoint {w.model_dir}: {total / 1e9:.2f} GB in {len(files)} files ({written})")
    df = subprocess.run(["df", "-hT", str(w.model_dir)], capture_output=True, text=True).stdout.splitlines()[-1:]
    print(f"filesystem {' '.join(df)}")
    evict_all(files)
    dd_cold = total / dd_seconds(files) / 1e9
    dd_warm = files[0].stat().st_size / dd_seconds(files[:1]) / 1e9
    print(f"dd bs=16M: {dd_cold:.2f} GB/s cold, {dd_warm:.2f} GB/s warm (the eviction works if cold is well below)")
    if dd_cold > 0.7 * dd_warm:
        print("EVICTION DID NOT TAKE (cold dd as fast as warm): the figures below are page-cache speeds, not disk")

    device = torch.device(args.device)
    start = time.perf_counter()
    model = build_model(ModelConfig.from_pretrained(w.model_dir), device, getattr(torch, args.dtype))
    sync(device)
    print(f"build on {device}: {time.perf_counter() - start:.2f} s")
    rows, reference = [], None
    for run in args.runs.split(","):
        seconds = timed_load(model, w.model_dir, run, files, device)
        rows.append(Row(run, "1", planned_bytes(model, files) / 1e9, seconds, total / seconds / 1e9))
        if args.check and reference is None and not run.startswith("safetensors"):
            reference = build_model(ModelConfig.from_pretrained(w.model_dir), device, getattr(torch, args.dtype))
            load_weights(reference, w.model_dir, "safetensors")
            bad = same_bits(model, reference)
            print(f"check {run} against safetensors: " + (f"DIFFERS in {bad[:4]}" if bad else "bit for bit equal"))
            del reference
            reference = True
    configure("auto")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.tp > 1:
        rows += tp_rows(args, w.model_dir, files, total)
    evict_all(files)
    dd_after = total / dd_seconds(files) / 1e9
    print(f"dd bs=16M again after the runs: {dd_after:.2f} GB/s cold; the runs are compared with the mean of both")
    dd_cold = (dd_cold + dd_after) / 2
    print(f"\n{'run':28} {'tp':>3} {'read GB':>8} {'s':>7} {'GB/s':>6} {'of dd':>6}")
    for r in rows:
        print(f"{r.run:28} {r.tp:>3} {r.read_gb:8.2f} {r.seconds:7.2f} {r.gbps:6.2f} {r.gbps / dd_cold:6.0%}")
    print(
        f"{'dd bs=16M (cold, mean)':28} {'':>3} {total / 1e9:8.2f} {total / 1e9 / dd_cold:7.2f} {dd_cold:6.2f} {1:6.0%}"
    )


if __name__ == "__main__":
    main()
