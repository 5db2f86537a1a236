"""W3's attention kernels built for sm_90a from their real launches (tests/support/attention_sm90_build.py): the
JIT's own specialization of the cache stride tuples keeps every stride 16-divisible or constant, and the builds keep
16-byte cache accesses and no spills. Seen failing (rc 1, every build but the merge) on caches whose head stride is
not 16-divisible, which is what a lost specialization looks like to the kernels."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.processes import ROOT


def test_w3_attention_builds_keep_stride_hints_and_wide_cache_accesses():
    # a compiler run, so outside the interpreter this suite sets
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.support.attention_sm90_build"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines()[1:] if line.strip()]
    assert not [r for r in rows if r.startswith("FAILED")] and len(rows) == 9, proc.stdout
    # the tiles the backend picks for W3 on an H100: one split of 128-key tiles at batch 256, 64-key splits at 64
    assert rows[0].startswith("decode, batch 256: 1 split(s), tiles 128,4,2 / split decode"), rows[0]
    assert rows[1].startswith("decode, batch 64: 8 split(s), tiles 64,4,2 / split decode"), rows[1]
