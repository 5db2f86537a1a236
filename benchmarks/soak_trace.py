"""Run launch.py with tracemalloc on, writing a heap snapshot every ``--every`` seconds (default 30) into DIR, for
finding what grows in the coordinator under a soak (benchmarks/soak.py --tracemalloc DIR):

    python -m benchmarks.soak_trace [--every S] DIR -- [launch.py flags]  # the server, snapshotting
    python -m benchmarks.soak_trace --compare DIR [--top 15]           # the largest growths: 2nd -> final

Tracing starts when the server's loop does; the first snapshot is taken ``--every`` seconds later; comparing from
the second one leaves out the warm-up (first compiles, caches that fill once). A last one is taken when the loop
ends: after the soak, idle, so what it holds beyond the second is not requests in flight."""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
import tracemalloc
from pathlib import Path

FRAMES = 8  # deep enough to see which of our functions allocated under the library calls


def _snapshots(out: Path, every_s: float) -> None:
    for i in range(1_000_000):
        time.sleep(every_s)
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        snap.dump(str(out / f"snap_{i:04d}.tracemalloc"))
        cur, _ = tracemalloc.get_traced_memory()
        print(f"soak_trace: snapshot {i}: {cur / 2**20:.1f} MiB traced", file=sys.stderr, flush=True)


def _trim(every_s: float) -> None:
    libc = ctypes.CDLL(None)
    while True:
        time.sleep(every_s)
        libc.malloc_trim(0)


def compare(directory: Path, top: int, base_index: int = 1) -> None:
    files = sorted(directory.glob("snap_*.tracemalloc"))
    if len(files) < 2:
        sys.exit(f"need two snapshots in {directory}, found {len(files)}")
    first = files[min(base_index, len(files) - 2)]
    a, b = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(files[-1]))
    total = sum(s.size for s in b.statistics("filename")) - sum(s.size for s in a.statistics("filename"))
    print(f"{first.name} -> {files[-1].name}: traced total {total / 2**20:+.2f} MiB")
    for key in ("lineno", "traceback"):
        print(f"-- top {top} by {key}")
        for stat in b.compare_to(a, key)[:top]:
            print(f"{stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks  {stat.traceback.format()[-1]}")
            if key == "traceback":
                for line in stat.traceback.format()[-2 * FRAMES : -1]:
                    print("      " + line)


def add_trim_flag(p: argparse.ArgumentParser) -> None:
    """--trim-every, for this script and for benchmarks/soak.py, which passes it on to it."""
    p.add_argument(
        "--trim-every",
        type=float,
        default=0.0,
        metavar="S",
        help="the coordinator calls glibc's malloc_trim(0) every S seconds: RSS growth that this gives back is freed "
        "memory the allocator kept, not live objects (default off)",
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("dir", type=Path, help="where the snapshots go (or are read from, with --compare)")
    p.add_argument("launch_flags", nargs="*", help="after --: launch.py's flags")
    p.add_argument("--every", type=float, default=30.0, help="seconds between snapshots (default 30)")
    add_trim_flag(p)
    p.add_argument("--no-trace", action="store_true", help="no tracemalloc (its own memory hides small growths)")
    p.add_argument("--compare", action="store_true", help="print the largest growths between DIR's snapshots")
    p.add_argument("--top", type=int, default=15, help="with --compare: how many lines (default 15)")
    p.add_argument("--base", type=int, default=1, help="with --compare: the snapshot to compare from (default 1)")
    a = p.parse_args(argv)
    if a.compare:
        compare(a.dir, a.top, a.base)
        return
    a.dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import launch
    from coordinator.server import Server

    serve = Server.serve

    def traced_serve(self, engine) -> None:
        # tracing starts once the engine is up: start-up (imports, model load) is not what grows, and tracing it
        # under load takes minutes
        if not a.no_trace:
            tracemalloc.start(FRAMES)
            threading.Thread(target=_snapshots, args=(a.dir, a.every), name="soak-trace", daemon=True).start()
        if a.trim_every > 0:
            threading.Thread(target=_trim, args=(a.trim_every,), name="soak-trim", daemon=True).start()
        try:
            serve(self, engine)
        finally:  # the soak waited for the server to go idle before stopping it: no request state is left
            if tracemalloc.is_tracing():
                tracemalloc.take_snapshot().dump(str(a.dir / "snap_9999_final.tracemalloc"))

    Server.serve = traced_serve
    sys.exit(launch.main(a.launch_flags))


if __name__ == "__main__":
    main()
