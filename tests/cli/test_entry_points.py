"""The edges a user touches first: every command-line entry point (launch.py, ``nanoserve``, ``python -m client``,
``python -m openai_server``, ``python -m worker``, every benchmark script) prints its help and exits 0,
describes every flag, refuses abbreviated flags; a benchmark that needs a GPU says so in one line and exits non-zero
without one. All of them run in one subprocess (tests/support/entry_points.py), so torch is imported once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support.processes import ROOT

BENCHMARKS = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "benchmarks").rglob("*.py")
    if 'if __name__ == "__main__":' in p.read_text()
)
ENTRY_POINTS = ["launch", "nanoserve.cli", "client", "openai_server", "worker", *BENCHMARKS]
# benchmarks that run only on CUDA, with the least arguments that get them past their argument checks
NEEDS_GPU = {
    "benchmarks.allreduce": [],
    "benchmarks.attention_kernels": [],
    "benchmarks.decode_gemm": [],
    "benchmarks.profile_step": [],
    "benchmarks.pc_sampling": [],
    "benchmarks.throughput": ["--workload", "W2", "--shape", "tiny", "--device", "cuda"],
    "benchmarks.whole_step_sweep": [],
}
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], dict]:
    cases = [(m, ["--help"]) for m in ENTRY_POINTS] + [(m, ["--hel"]) for m in ENTRY_POINTS]
    if NO_CUDA:
        cases += [(m, args) for m, args in NEEDS_GPU.items()]
    cmd = [sys.executable, "-m", "tests.support.entry_points", json.dumps(cases)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return {(m, " ".join(args)): r for (m, args), r in zip(cases, json.loads(out.stdout))}


def test_every_benchmark_script_is_listed():
    assert {"benchmarks.throughput", "benchmarks.shapes", *NEEDS_GPU} <= set(BENCHMARKS)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_describes_every_flag_and_exits_0(runs, module):
    r = runs[module, "--help"]
    assert r["code"] == 0 and r["stdout"].startswith("usage: "), r
    assert r["parsers"], "no argparse parser"
    for parser in r["parsers"]:
        assert parser["without_help"] == [], f"{parser['prog']}: flags without a description"
        assert parser["allow_abbrev"] is False, f"{parser['prog']} accepts abbreviated flags"


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_an_abbreviated_flag_is_refused(runs, module):
    r = runs[module, "--hel"]  # with abbreviations on, argparse would take this for --help
    assert r["code"] == 2 and r["stdout"] == "" and "error:" in r["stderr"], r


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
@pytest.mark.parametrize("module", sorted(NEEDS_GPU))
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line(runs, module):
    r = runs[module, " ".join(NEEDS_GPU[module])]
    assert r["code"] == 1 and r["stdout"] == "", r
    assert r["stderr"].count("\n") == 1 and "needs" in r["stderr"] and "CUDA GPU" in r["stderr"], r["stderr"]
