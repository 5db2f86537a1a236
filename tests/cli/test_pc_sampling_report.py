"""benchmarks/pc_sampling.py's report, read from a profile in the shape proton writes (a call tree of kernels,
their source lines as ``file:line@kernel`` children, one node per device after it)."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.pc_sampling import kernel_samples, summarize
from tests.support.processes import ROOT
from tests.support.timeouts import START_S


def node(name: str, samples: int = 0, children: list | None = None, **stalls: int) -> dict:
    metrics = {"num_samples": samples, **{f"stalled_{k}": v for k, v in stalls.items()}}
    return {"frame": {"name": name, "type": "function"}, "metrics": metrics, "children": children or []}


TREE = [
    node(
        "ROOT",
        children=[
            node(
                "_decode_split_kernel",
                children=[
                    node("/x/kernels/attention_decode.py:101@_decode_split_kernel", 600, long_scoreboard=400, wait=50),
                    node("/x/kernels/attention_store.py:127@_decode_split_kernel", 300, selected=150, wait=100),
                ],
            ),
            node("nvjet_hsh_128x256", 100, selected=30, long_scoreboard=60),  # a library kernel: no lines
        ],
    ),
    {"CUDA": {"0": {"arch": "90", "num_sms": 132}}},
]


def test_samples_are_grouped_by_kernel_and_line():
    got = kernel_samples(TREE)
    assert set(got) == {"_decode_split_kernel", "nvjet_hsh_128x256"}
    lines = {s.line: s.samples for s in got["_decode_split_kernel"]}
    assert lines == {"kernels/attention_decode.py:101": 600, "kernels/attention_store.py:127": 300}
    assert [(s.line, s.samples, s.stalls["long_scoreboard"]) for s in got["nvjet_hsh_128x256"]] == [(None, 100, 60)]


def test_report_ranks_kernels_and_lines_by_share():
    report = summarize(TREE).splitlines()
    assert report[0].startswith("1,000 samples")
    assert report[1].split()[:2] == ["90.0%", "_decode_split_kernel"] and "long_scoreboard 40.0%" in report[1]
    assert report[2].split()[:2] == ["10.0%", "nvjet_hsh_128x256"]
    first_line = report.index("_decode_split_kernel: lines") + 1
    assert report[first_line].split()[:2] == ["60.0%", "kernels/attention_decode.py:101"]
    assert report[first_line + 1].split()[:2] == ["30.0%", "kernels/attention_store.py:127"]


def test_a_saved_profile_is_summarized_without_a_gpu(tmp_path):
    path = tmp_path / "pcs.hatchet"
    path.write_text(json.dumps(TREE))
    cmd = [sys.executable, "-m", "benchmarks.pc_sampling", "--summarize", str(path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 0 and out.stdout == summarize(TREE) + "\n", out.stderr
