"""Start-up, as launch.py runs it: each process reports one line of its phase times at ready (the coordinator's and
every worker rank's, settings/startup_phases.py), which benchmarks/startup.py reads back into its table; and the
workers spawned before the coordinator's own imports (nanoserve/serve.py) are stopped at once, none left behind,
when the engine then refuses its arguments."""

from __future__ import annotations

import subprocess
import sys

from settings.startup_phases import StartupPhases, parse_line
from tests.support.processes import ROOT, children_of
from tests.support.server import ENGINE_ARGS, ServerProcess
from tests.support.timeouts import HANG_S, START_S

WORKER_PHASES = ["python", "hello", "imports", "wait config", "weights", "kv sizing", "kv alloc"]
COORDINATOR_PHASES = ["python", "spawn workers", "engine imports", "engine: tokenizer + workers"]


def _reports(stderr: str) -> dict[str, tuple[float, dict[str, float]]]:
    return {who: (total, phases) for who, total, phases in filter(None, map(parse_line, stderr.splitlines()))}


def test_a_phase_line_reads_back():
    phases = StartupPhases(age_s=0.5)
    phases.mark("engine: tokenizer + workers")
    with phases.phase("kv alloc"):
        pass
    who, total, parts = parse_line("12:00:00 any prefix " + phases.line("rank 3"))
    assert who == "rank 3" and total >= 0.5
    assert list(parts) == ["cpu", "python", "engine: tokenizer + workers", "kv alloc"] and parts["python"] == 0.5
    for line in ["nanoserve listening on tcp://x", "nanoserve[startup] rank 0 ready in soon s (cpu 1 s): a 1"]:
        assert parse_line(line) is None


def test_every_process_reports_its_phases_at_ready(tiny_tied, tmp_path):
    with ServerProcess(tiny_tied, tmp_path / "server.log", "--tp", "2") as srv:
        stderr = srv.stderr()
    reports = _reports(stderr)
    assert sorted(reports) == ["coordinator", "rank 0", "rank 1"], stderr
    for who, (total, phases) in reports.items():
        wanted = COORDINATOR_PHASES if who == "coordinator" else WORKER_PHASES
        assert [p for p in wanted if p not in phases] == [], (who, phases)
        cpu = phases.pop("cpu")  # the process's CPU seconds, beside the wall times
        assert all(s >= 0 for s in phases.values()) and total > 0 and cpu > 0
        assert sum(phases.values()) <= total + 0.05 * len(phases), (who, total, phases)  # rounding of each


def test_the_benchmark_tables_the_phases(tiny_tied, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.startup", "--runs", "1", "--log-dir", str(tmp_path), "--model",
           str(tiny_tied), "--", *ENGINE_ARGS]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S + HANG_S)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for row in ["wall: launch -> listening", "wall: launch -> first token", "coordinator: engine imports",
                "rank 0: weights", "rank 0: kv alloc", "rank 0: cpu"]:  # fmt: skip
        assert any(line.startswith(row) for line in lines), (row, out.stdout)


def test_a_refusal_after_the_workers_spawned_stops_them_at_once(tiny_tied, tmp_path):
    """--max-model-len past the model's limit is refused by the engine (it needs the model's config), after the
    workers were spawned: they are killed rather than waited for (here the wait would be an hour), and none is
    left behind."""
    code = (
        "import sys; import coordinator.worker_group as g; g.EXIT_GRACE_S = 3600.0; "
        "from nanoserve.serve import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["--port", "0", "--model", str(tiny_tied), *ENGINE_ARGS, "--max-model-len", "99999999"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=START_S)
    finally:
        workers = children_of(proc.pid)
        proc.kill()
    assert proc.returncode == 2, err
    assert "error: argument --max-model-len" in err
    assert workers == []
