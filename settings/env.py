"""Every environment variable nanoserve reads, in one typed place (the README's table lists them all).

Switches share one polarity: a feature is on unless its variable is "0" (the one exception, a benchmark-only
switch, is off unless "1"). Values are read at call time, never at
import, so a test or a launcher can set a variable before the code that uses it runs; hot paths cache what they
read (kernels/pdl.py per device). A performance switch lives only while its experiment is open: once the log
(docs/PERFORMANCE_LOG.md) names the winner, the winner is the code and the switch goes. What remains are operators'
settings, escape hatches, a start-up cost and diagnostics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "NANOSERVE_"


def _switch(name: str) -> bool:
    return os.environ.get(PREFIX + name, "1").strip() != "0"


def _flag(name: str) -> bool:
    """An opt-in switch (benchmark only): on when the variable is "1"."""
    return os.environ.get(PREFIX + name, "0").strip() == "1"


def _text(name: str) -> str | None:
    value = os.environ.get(PREFIX + name, "").strip()
    return value or None


@dataclass(frozen=True, slots=True)
class Settings:
    # NANOSERVE_CACHE: where the benchmark checkpoints (model shapes) are written and what start-up keeps across
    # starts (kernels/tune_cache.py's tuning choices, coordinator/tokenizer_loader.py's tokenizer classes); safe
    # to delete
    cache_dir: Path
    api_key: str | None  # NANOSERVE_API_KEY: the server's shared secret (clients send it, servers require it)
    # NANOSERVE_WORKER_SECRET: what every worker proves it holds before it gets any work; unset: the API key
    worker_secret: str | None
    address: str | None  # NANOSERVE_ADDRESS: the ZMQ address `python -m client` talks to
    step_trace: str | None  # NANOSERVE_STEP_TRACE: rank 0 writes each step's device and idle time to this file
    # NANOSERVE_SYMM_MEM=0: every all-reduce through NCCL, no symmetric memory (and so no fused all-reduce + norm).
    # Kept as the escape hatch from our own collectives on an interconnect or driver where they misbehave
    symm_mem: bool
    # NANOSERVE_PDL=0: our Triton kernels launch without programmatic dependent launch. Kept as a diagnostic: kernel
    # times that do not overlap (profile_step's ledger) and a bisection of ordering races (logs 30c, 32b)
    pdl: bool
    # NANOSERVE_LT_TUNE=0: skip the start-up choice of cuBLASLt algorithms. Kept as a start-up knob: the choice costs
    # up to 5 s a start (worker/startup.TUNE_BUDGET_S) for +0.3-0.7% of W1 (log 16d), worth skipping for a quick start
    lt_tune: bool
    # NANOSERVE_BENCH_ACCEPT_DRAFTS=1 (off unless "1": benchmark only, outputs are wrong): every sequence gets a
    # draft each try and workers accept every draft, so speculative decoding runs at its ceiling
    bench_accept_drafts: bool
    triton_interpret: bool  # TRITON_INTERPRET=1: Triton kernels run on CPU tensors (tests)
    # CUDA_VISIBLE_DEVICES, as CUDA reads it (None: unset, every GPU): the coordinator counts GPUs without torch
    cuda_visible_devices: str | None


def settings() -> Settings:
    """The current environment's settings."""
    return Settings(
        cache_dir=Path(_text("CACHE") or Path.home() / ".cache" / "nanoserve"),
        api_key=_text("API_KEY"),
        worker_secret=_text("WORKER_SECRET") or _text("API_KEY"),
        address=_text("ADDRESS"),
        step_trace=_text("STEP_TRACE"),
        symm_mem=_switch("SYMM_MEM"),
        pdl=_switch("PDL"),
        lt_tune=_switch("LT_TUNE"),
        bench_accept_drafts=_flag("BENCH_ACCEPT_DRAFTS"),
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
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
