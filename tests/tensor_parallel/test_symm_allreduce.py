"""Symmetric-memory all-reduce (comm/custom_all_reduce.py): on two CUDA GPUs, comm.parallel.all_reduce and each forced
kernel equal NCCL's sum eagerly and under CUDA graph capture/replay (benchmarks/allreduce.py --check under
torchrun), and the fused all-reduce + add + RMSNorm equals the unfused pair (--fused-norm). On the CPU only the
fallback rules run."""

import os
import subprocess

import pytest
import torch

from comm import custom_all_reduce, parallel
from tests.support.processes import ROOT, torchrun_cmd


def test_fallback_without_cuda_tp_group():
    # tp 1, or a CPU device: nothing to set up, no collective, all_reduce stays a no-op / gloo
    parallel.set_tp(0, 1)
    assert custom_all_reduce.init_custom_all_reduce(1 << 20, torch.bfloat16, "cpu") is False
    assert custom_all_reduce.get_symm_all_reduce() is None
    x = torch.ones(4)
    assert parallel.all_reduce(x) is x
    parallel.set_tp(0, 2)
    try:
        assert custom_all_reduce.init_custom_all_reduce(1 << 20, torch.bfloat16, "cpu") is False
        assert custom_all_reduce.get_symm_all_reduce() is None
    finally:
        parallel.set_tp(0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_symm_all_reduce_matches_nccl_under_torchrun():
    cmd = torchrun_cmd(2, "benchmarks.allreduce", "--check")
    env = dict(os.environ)
    env.pop("NANOSERVE_SYMM_MEM", None)
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert '"symm": true' in out.stdout and '"ok": true' in out.stdout, out.stdout[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fused_all_reduce_norm_matches_unfused_under_torchrun():
    # eagerly and in a replayed graph of chained calls (both buffer halves), ragged row counts, both tile heights
    cmd = torchrun_cmd(2, "benchmarks.allreduce", "--fused-norm")
    cmd += ["--sizes", "1,7,64,300,2049", "--graph-calls", "2", "--replays", "2"]
    env = dict(os.environ)
    env.pop("NANOSERVE_SYMM_MEM", None)  # switches on unless "0" (settings/env.py)
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert '"bench": "fused_norm"' in out.stdout and '"ok": true' in out.stdout, out.stdout[-4000:]
