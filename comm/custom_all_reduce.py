"""Custom all-reduces for tensor parallelism on CUDA, used by comm/parallel.py's collectives once set up.

On CUDA with tp > 1, small all-reduces can go through PyTorch's symmetric memory (one preallocated buffer that
every rank maps, reduced by the one-shot / two-shot kernels of ``torch.ops.symm_mem``) instead of NCCL, whose
fixed latency dominates decode steps (two all-reduces per layer). The two per layer that feed an RMSNorm go
through ``all_reduce_add_rmsnorm`` instead: our own kernel (kernels/allreduce_norm.py) over a second symmetric
buffer, which also adds the residual and normalizes. ``init_custom_all_reduce`` sets both up once, before
weights are loaded and CUDA graphs are captured; anything it cannot do leaves NCCL in place. The two reducers
(``SymmAllReduce``, ``FusedAllReduceNorm``) live in comm/symm_reducers.py; this module allocates, rendezvouses and
self-tests them, the same on every rank."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from comm.parallel import REDUCERS, tp_group, tp_rank, tp_size
from comm.symm_reducers import FusedAllReduceNorm, SymmAllReduce
from settings.env import settings

# Size cut-offs of the symmetric-memory all-reduce, in bytes per rank, from benchmarks/allreduce.py (2 NVLink
# H200s, bf16, in CUDA graphs): one-shot (every rank reads each peer's whole buffer: lowest latency, 6.7 us at
# 8 KB vs NCCL's 11.9) wins to ~1 MiB, two-shot (reduce-scatter + all-gather through the buffer: less NVLink
# traffic, 19 us at 2 MiB vs 31) to ~32 MiB; NCCL wins at 64 MiB (prefill-sized messages).
ONE_SHOT_MAX_BYTES = 512 * 1024
TWO_SHOT_MAX_BYTES = 16 * 1024 * 1024
_SYMM_DTYPES = (torch.bfloat16, torch.float32)  # what the symm_mem reduction kernels dispatch on

# The fused all-reduce + add + RMSNorm (kernels/allreduce_norm.py) up to this size per call; above it, NCCL (or the
# two-shot kernel) and then the norm kernel. Measured on 2 H200s: 1.5-1.9x faster than the unfused pair at decode
# sizes, still 1.13x at 64 MiB (an 8,192-token prefill step of Qwen3-8B).
FUSED_MAX_BYTES = 64 * 1024 * 1024


def _torch_version() -> tuple[int, int]:
    try:
        major, minor = torch.__version__.split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (99, 0)


def _log(msg: str) -> None:
    print(f"nanoserve[rank {tp_rank()}]: {msg}", file=sys.stderr, flush=True)


def _all_ranks_ok(ok: bool, device: torch.device, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def get_symm_all_reduce() -> SymmAllReduce | None:
    """The active symmetric-memory all-reduce, or None when all_reduce uses NCCL only."""
    return REDUCERS.symm


def init_custom_all_reduce(
    max_bytes: int,
    dtype: torch.dtype,
    device: torch.device | str,
    one_shot_max: int = ONE_SHOT_MAX_BYTES,
    two_shot_max: int = TWO_SHOT_MAX_BYTES,
) -> bool:
    """Set up the symmetric-memory all-reduce; True if all_reduce will use it.

    The buffer holds min(max_bytes, two_shot_max) bytes (max_bytes: the largest all-reduce the caller issues),
    all that all_reduce can use; it is never reallocated. Call once, after set_tp and before any CUDA graph
    capture, on every rank of the group: with tp > 1 on CUDA over NCCL it is collective. Never raises for
    symm_mem trouble: a rank that hits some logs one line to stderr, and all ranks agree to keep NCCL."""
    REDUCERS.symm = REDUCERS.fused = None
    device = torch.device(device)
    if tp_size() <= 1 or device.type != "cuda" or not dist.is_initialized():
        return False
    group = tp_group() if tp_group() is not None else dist.group.WORLD
    if dist.get_backend(group) != "nccl":
        return False
    # From here on every rank runs the same collectives (the votes), whatever fails locally.
    disabled = not settings().symm_mem
    policy = disabled or dtype not in _SYMM_DTYPES  # the same on every rank: rank 0 alone says so
    symm, buf = None, None
    if disabled:
        reason = "NANOSERVE_SYMM_MEM=0"
    elif dtype not in _SYMM_DTYPES:
        reason = f"the symm_mem kernels do not reduce {dtype}"
    else:
        buf, reason = _allocate(min(int(max_bytes), int(two_shot_max)), dtype, device)
    if _all_ranks_ok(reason is None, device, group):
        symm, reason = _rendezvous(buf, group.group_name, one_shot_max, two_shot_max)
        if _all_ranks_ok(reason is None, device, group):
            try:  # also the eager first use of each kernel, which graph capture wants to have happened
                reason = symm.self_test(tp_rank(), tp_size())
            except Exception as e:
                reason = f"self-test failed ({type(e).__name__}: {e})"
            if _all_ranks_ok(reason is None, device, group):
                REDUCERS.symm = symm
                _init_fused(min(int(max_bytes), FUSED_MAX_BYTES), dtype, device, group)
                if tp_rank() == 0:
                    fused = " (fused copy)" if symm._one_copy is not None else ""
                    _log(
                        f"symmetric-memory all-reduce on ({dtype}, buffer {symm.buffer_bytes >> 10} KiB): one-shot"
                        f" <= {one_shot_max >> 10} KiB{fused}, two-shot <= {two_shot_max >> 10} KiB, NCCL above"
                    )
                return True
    if reason is None:
        reason, policy = "another rank could not set up symmetric memory", True
    if tp_rank() == 0 or not policy:
        _log(f"symmetric-memory all-reduce off, NCCL only: {reason}")
    return False


def _init_fused(nbytes: int, dtype: torch.dtype, device: torch.device, group) -> None:
    """Collective: the fused all-reduce + RMSNorm's buffer (two halves of ``nbytes``), or None where it cannot be
    set up (symmetric memory itself works here: init_custom_all_reduce got this far)."""
    fused = None
    buf, reason = _allocate(2 * nbytes, dtype, device)
    if _all_ranks_ok(reason is None, device, group):
        try:
            import torch.distributed._symmetric_memory as symm_mem

            handle = symm_mem.rendezvous(buf, group.group_name)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            fused = FusedAllReduceNorm(buf, handle, tp_rank(), tp_size(), 2 * sms)
            reason = fused.self_test()
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if _all_ranks_ok(reason is None, device, group):
            REDUCERS.fused = fused
            if tp_rank() == 0:
                _log(f"fused all-reduce + RMSNorm on (<= {nbytes >> 10} KiB per call, {fused.max_programs} programs)")
            return
    if reason is not None:
        _log(f"fused all-reduce + RMSNorm off: {reason}")


def get_fused_all_reduce_norm() -> FusedAllReduceNorm | None:
    return REDUCERS.fused


def _allocate(nbytes: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor | None, str | None]:
    try:
        # Never create NVLink multicast objects (no multimem op is used; multicast is off on our hosts), and
        # allocate the buffer directly (its own block, at offset 0) rather than from the implicit MemPool.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("TORCH_SYMMMEM_IMPLICIT_POOL", "0")
        import torch.distributed._symmetric_memory as symm_mem

        ops = torch.ops.symm_mem
        _ = ops.one_shot_all_reduce_out.default, ops.two_shot_all_reduce_.default
        try:
            backend = symm_mem.get_backend(device)
        except Exception:  # older torch: no backend choice, always CUDA
            backend = None
        if backend not in (None, "CUDA"):  # NVSHMEM / NCCL backends: not what these ops were checked with
            raise RuntimeError(f"symm_mem backend is {backend}, not CUDA")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = max(16, -(-nbytes // 16) * 16) // itemsize
        return symm_mem.empty(numel, dtype=dtype, device=device), None
    except Exception as e:  # no symm_mem in this build, missing ops, no CUDA driver API, out of memory, ...
        return None, f"symmetric memory unavailable ({type(e).__name__}: {e})"


def _rendezvous(buf: torch.Tensor, group_name: str, one_shot_max: int, two_shot_max: int):
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if _torch_version() < (2, 11) and hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)  # required before 2.11; deprecated and unneeded since
        if symm_mem.rendezvous(buf, group_name) is None:  # collective: the ranks map each other's buffers
            raise RuntimeError("rendezvous returned no handle")
        return SymmAllReduce(buf, group_name, tp_size(), one_shot_max, two_shot_max), None
    except Exception as e:
        return None, f"rendezvous failed ({type(e).__name__}: {e})"
