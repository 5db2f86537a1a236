"""Every environment variable nanoserve reads, in one typed place (the README lists them).

Switches share one polarity: a feature is on unless its variable is "0". Values are read at call time, so a test or
a launcher can set a variable before the process that uses it starts; hot paths cache what they read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "NANOSERVE_"


def _switch(name: str) -> bool:
    return os.environ.get(PREFIX + name, "1").strip() != "0"


def _text(name: str) -> str | None:
    value = os.environ.get(PREFIX + name, "").strip()
    return value or None


@dataclass(frozen=True, slots=True)
class Settings:
    cache_dir: Path  # NANOSERVE_CACHE: where the embedded default model and benchmark checkpoints are written
    api_key: str | None  # NANOSERVE_API_KEY: the server's shared secret (clients send it, servers require it)
    # NANOSERVE_WORKER_SECRET: what every worker proves it holds before it gets any work; unset: the API key
    worker_secret: str | None
    address: str | None  # NANOSERVE_ADDRESS: the ZMQ address `python -m client` talks to
    step_trace: str | None  # NANOSERVE_STEP_TRACE: rank 0 writes each step's device and idle time to this file
    symm_mem: bool  # NANOSERVE_SYMM_MEM=0: every all-reduce through NCCL, no symmetric memory
    fused_all_reduce: bool  # NANOSERVE_FUSED_ALL_REDUCE=0: all-reduce and RMSNorm as two kernels
    pdl: bool  # NANOSERVE_PDL=0: launch our Triton kernels without programmatic dependent launch
    decode_gemm: bool  # NANOSERVE_DECODE_GEMM=0: every linear layer through cuBLAS
    gemv_norm: bool  # NANOSERVE_GEMV_NORM=0: a decode row's add + RMSNorm as a launch of its own, not in the GEMV
    lt_tune: bool  # NANOSERVE_LT_TUNE=0: skip the start-up choice of cuBLASLt algorithms (faster start)
    moe_norm_route: bool  # NANOSERVE_MOE_NORM_ROUTE=0: a MoE layer's norm, router and routing as three launches
    fp8_scalar_gemm: bool  # NANOSERVE_FP8_SCALAR_GEMM=0: per-channel FP8 products always take rowwise scales
    fp8_fused_mlp: bool  # NANOSERVE_FP8_FUSED_MLP=0: an FP8 MLP's rescale, SiLU-and-mul and quantization unfused
    fp8_quantized_rows: bool  # NANOSERVE_FP8_QUANTIZED_ROWS=0: FP8 GEMV rows quantized in the GEMV, not before
    fp8_norm_quantizes: bool  # NANOSERVE_FP8_NORM_QUANTIZES=0: 2+ FP8 rows quantized by a launch after the RMSNorm
    fp8_folded_scales: bool  # NANOSERVE_FP8_FOLDED_SCALES=0: FP8 decode products rescaled by a launch of their own
    fp8_f16_sums: bool  # NANOSERVE_FP8_F16_SUMS=0: the one-row FP8 GEMV sums its products in float32 only
    fp8_v_keys: bool  # NANOSERVE_FP8_V_KEYS=0: an e4m3 V cache in the [keys, head_dim] page layout of 16-bit ones
    triton_interpret: bool  # TRITON_INTERPRET=1: Triton kernels run on CPU tensors (tests)


def settings() -> Settings:
    """The current environment's settings."""
    return Settings(
        cache_dir=Path(_text("CACHE") or Path.home() / ".cache" / "nanoserve"),
        api_key=_text("API_KEY"),
        worker_secret=_text("WORKER_SECRET") or _text("API_KEY"),
        address=_text("ADDRESS"),
        step_trace=_text("STEP_TRACE"),
        symm_mem=_switch("SYMM_MEM"),
        fused_all_reduce=_switch("FUSED_ALL_REDUCE"),
        pdl=_switch("PDL"),
        decode_gemm=_switch("DECODE_GEMM"),
        gemv_norm=_switch("GEMV_NORM"),
        lt_tune=_switch("LT_TUNE"),
        moe_norm_route=_switch("MOE_NORM_ROUTE"),
        fp8_scalar_gemm=_switch("FP8_SCALAR_GEMM"),
        fp8_fused_mlp=_switch("FP8_FUSED_MLP"),
        fp8_quantized_rows=_switch("FP8_QUANTIZED_ROWS"),
        fp8_norm_quantizes=_switch("FP8_NORM_QUANTIZES"),
        fp8_folded_scales=_switch("FP8_FOLDED_SCALES"),
        fp8_f16_sums=_switch("FP8_F16_SUMS"),
        fp8_v_keys=_switch("FP8_V_KEYS"),
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
    )


@dataclass(frozen=True, slots=True)
class DistributedEnv:
    """torchrun's variables: rank, world size, local rank and the number of ranks on this host."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def distributed_env(
    rank: int | None = None, world_size: int | None = None, local_rank: int | None = None
) -> DistributedEnv:
    """Arguments win over torchrun's environment, which wins over a single-process default."""
    r = rank if rank is not None else int(os.environ.get("RANK", 0))
    w = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    lr = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", r))
    return DistributedEnv(r, w, lr, int(os.environ.get("LOCAL_WORLD_SIZE", w)))
