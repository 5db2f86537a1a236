"""Start-up time of ``python launch.py``, by phase: the wall time from the command to "listening" (ready) and to the
first token of one request, and the phases each process reports (settings/startup_phases.py: the coordinator's
line and each worker rank's), for a cold start and then warm ones.

    python -m benchmarks.startup [--model DIR | --shape qwen3-8b] [--runs 2] [--keep-caches] [--http]
        [-- ENGINE FLAGS...]

No --model or --shape: the embedded default model (on the CPU where there is no GPU). ``--shape`` runs a real
model's shape with random weights (``--load-format dummy``). The first run is cold for what nanoserve caches
across starts: unless ``--keep-caches``, every run uses fresh directories for NANOSERVE_CACHE (the cuBLASLt
choices, kernels/tune_cache.py) and TRITON_CACHE_DIR, shared by the runs (and removed after them), so run 1
fills them and the later runs read them. The OS file cache is not dropped (that needs root): run 1 also pays for
files read the first time. The table lists each phase's seconds per run; the warm column is the median of the
runs after the first; "cpu at ready" is each process's CPU time from /proc (on a busy host the wall times grow,
it does not). ``--http`` starts the HTTP front-end too (``--http-port 0``, as the README's first command does) and
adds the wall time to its line (``nanoserve OpenAI API on``) and its CPU time then. The LAST line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from settings.startup_phases import parse_line

ROOT = Path(__file__).resolve().parent.parent
LISTENING = "nanoserve listening on "
OPENAI_API = "nanoserve OpenAI API on "  # the HTTP front-end's line, once it answers


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory (default: the embedded model)")
    src.add_argument("--shape", help="a model shape of benchmarks/shapes.py, with random weights")
    p.add_argument("--runs", type=int, default=2, help="starts: the first cold, the rest warm (default 2)")
    p.add_argument("--keep-caches", action="store_true", help="use the environment's caches (no cold run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take (default 600)")
    p.add_argument("--http", action="store_true", help="start the HTTP front-end too (--http-port 0) and time its line")
    p.add_argument("--log-dir", help="keep each run's output here (default: a temp dir, printed on failure)")
    p.add_argument("engine_flags", nargs="*", help="after --: launch.py's engine flags")
    return p.parse_args(argv)


class _Run:
    """One ``launch.py --port 0``: its output lines, timed from the launch."""

    def __init__(self, cmd: list[str], env: dict, log: Path) -> None:
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.log = log.open("w")
        self.readers = [
            threading.Thread(target=self._read, args=(s,), daemon=True) for s in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self.readers:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.lines.append((time.perf_counter() - self.start, line.rstrip("\n")))
                self.log.write(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> tuple[float, str]:
        """(seconds since launch, the line) of the first line holding ``text``; raises if the process ends first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for at, line in self.lines:
                    if text in line:
                        return at, line
                if self.proc.poll() is not None and not any(t.is_alive() for t in self.readers):
                    raise RuntimeError(f"launch.py exited with code {self.proc.returncode} before {text!r}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {text!r} within {timeout:g} s")
                self.cond.wait(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: the server drains and stops its workers
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for t in self.readers:
            t.join(5)
        self.log.close()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from /proc (0.0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0.0


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _first_token(address: str) -> float:
    """Seconds from sending one request to its first streamed token."""
    from client import Client, SamplingParams

    with Client(address) as c:
        start = time.perf_counter()
        for _ in c.stream([1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0)):
            return time.perf_counter() - start
    raise RuntimeError("the request streamed nothing")


def one_start(cmd: list[str], env: dict, log: Path, timeout: float, http: bool = False) -> dict:
    run = _Run(cmd, env, log)
    try:
        ready, line = run.wait_for(LISTENING, timeout)
        pid = run.proc.pid  # CPU seconds at ready, from /proc: comparable with a build that reports no phases
        front_end = [c for c in _children(pid) if b"openai_server" in _cmdline(c)]
        workers = [c for c in _children(pid) if c not in front_end]
        cpu = {"coordinator": _cpu_s(pid), "workers": sum(_cpu_s(c) for c in workers)}
        http_ready = None
        if http:
            http_ready, _ = run.wait_for(OPENAI_API, timeout)
            cpu["front-end"] = sum(_cpu_s(c) for c in front_end)
        ttft = _first_token(line.split(LISTENING, 1)[1].strip())
        first = time.perf_counter() - run.start
    finally:
        run.stop()
    phases: dict[str, dict] = {}
    tuning = ""
    for _, text in run.lines:
        parsed = parse_line(text)
        if parsed:
            who, total, parts = parsed
            phases[who] = {"ready": total, **parts}
        if "nanoserve[gemm tuning]" in text and not tuning:
            tuning = text.split("(", 1)[1].split(")", 1)[0]  # "(12.3 s, 0 of 120 read from ...)"
    return {
        "ready_s": ready,
        **({"http_ready_s": http_ready} if http else {}),
        "first_token_s": first,
        "request_ttft_s": ttft,
        "cpu_at_ready_s": cpu,
        "phases": phases,
        "gemm_tuning": tuning,
    }


def _table(results: list[dict]) -> list[str]:
    cold, warm = results[0], results[1:]
    cols = ["run 1 (cold)"] + ([f"warm (median of {len(warm)})"] if warm else [])
    rows: list[tuple[str, list[float]]] = [
        ("wall: launch -> listening", [r["ready_s"] for r in results]),
        *([("wall: launch -> HTTP answers", [r["http_ready_s"] for r in results])] if "http_ready_s" in cold else []),
        ("wall: launch -> first token", [r["first_token_s"] for r in results]),
        ("one request's first token", [r["request_ttft_s"] for r in results]),
        ("cpu at ready: coordinator", [r["cpu_at_ready_s"]["coordinator"] for r in results]),
        ("cpu at ready: workers", [r["cpu_at_ready_s"]["workers"] for r in results]),
        *(
            [("cpu at HTTP: front-end", [r["cpu_at_ready_s"]["front-end"] for r in results])]
            if "http_ready_s" in cold
            else []
        ),
    ]
    whos = [w for w in cold["phases"] if w == "coordinator"] + sorted(w for w in cold["phases"] if w != "coordinator")
    for who in whos:
        names = list(dict.fromkeys(n for r in results for n in r["phases"].get(who, {})))
        for name in names:
            rows.append((f"{who}: {name}", [r["phases"].get(who, {}).get(name, float("nan")) for r in results]))
    width = max(len(name) for name, _ in rows) + 2
    out = [f"{'':<{width}}" + "".join(f"{c:>22}" for c in cols)]
    for name, values in rows:
        shown = [values[0]] + ([statistics.median(values[1:])] if warm else [])
        out.append(f"{name:<{width}}" + "".join(f"{v:>20.2f} s" for v in shown))
    for i, r in enumerate(results):
        if r["gemm_tuning"]:
            out.append(f"run {i + 1} gemm tuning: {r['gemm_tuning']}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    flags = list(args.engine_flags)
    model = args.model
    if args.shape:
        from benchmarks.shapes import write_shape

        model = str(write_shape(args.shape))
        flags = ["--load-format", "dummy", *flags]
    http = ["--http-port", "0"] if args.http else []
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        "--port",
        "0",
        *http,
        *(["--model", model] if model else []),
        *flags,
    ]
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="nanoserve-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    caches = None
    if not args.keep_caches:  # fresh and shared by the runs: run 1 fills them (cold), the rest read them (warm)
        caches = Path(tempfile.mkdtemp(prefix="nanoserve-startup-caches-"))
        env["NANOSERVE_CACHE"] = str(caches / "nanoserve")
        env["TRITON_CACHE_DIR"] = str(caches / "triton")
    print(" ".join(cmd), f"(logs in {work})", flush=True)
    results = []
    try:
        for i in range(args.runs):
            try:
                results.append(one_start(cmd, env, work / f"run{i + 1}.log", args.timeout, args.http))
            except (RuntimeError, TimeoutError, OSError) as e:
                print(f"run {i + 1} failed: {e}; its output: {work / f'run{i + 1}.log'}", file=sys.stderr)
                return 1
            r = results[-1]
            print(f"run {i + 1}: ready {r['ready_s']:.2f} s, first token {r['first_token_s']:.2f} s", flush=True)
    finally:
        if caches is not None:
            shutil.rmtree(caches, ignore_errors=True)
    print("\n".join(_table(results)))
    print(json.dumps({"command": cmd, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
