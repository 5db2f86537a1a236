"""Custom all-reduces for tensor parallelism on CUDA, used by model/parallel.py's collectives once set up.

On CUDA with tp > 1, small all-reduces can go through PyTorch's symmetric memory (one preallocated buffer that
every rank maps, reduced by the one-shot / two-shot kernels of ``torch.ops.symm_mem``) instead of NCCL, whose
fixed latency dominates decode steps (two all-reduces per layer). The two per layer that feed an RMSNorm go
through ``all_reduce_add_rmsnorm`` instead: our own kernel (kernels/allreduce_norm.py) over a second symmetric
buffer, which also adds the residual and normalizes. ``init_custom_all_reduce`` sets both up once, before
weights are loaded and CUDA graphs are captured; anything it cannot do leaves NCCL in place."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from model.parallel import REDUCERS, tp_group, tp_rank, tp_size
from protocol.settings import settings

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


class SymmAllReduce:
    """One rendezvoused symmetric buffer and the symm_mem reduction ops over it.

    Each call copies ``x`` into the buffer's prefix (a view at offset 0), reduces, and writes the sum back into
    ``x``. Every kernel ends with a cross-rank barrier, so the next call may overwrite the buffer at once. Kernels
    only (no host synchronization, no allocation): safe to capture in CUDA graphs once the buffer has been
    rendezvoused and used eagerly, as long as every rank replays the same graphs in the same order (true here:
    all ranks run the same steps). Multimem (NVLink SHARP) ops are never used."""

    def __init__(self, buf: torch.Tensor, group_name: str, world_size: int, one_shot_max: int, two_shot_max: int):
        ops = torch.ops.symm_mem
        self.buf, self.group_name, self.dtype = buf, group_name, buf.dtype
        self.buffer_bytes = buf.numel() * buf.element_size()
        self.one_shot_max, self.two_shot_max = one_shot_max, two_shot_max  # all_reduce's cut-offs (bytes)
        self._one = ops.one_shot_all_reduce_out.default
        self._two = ops.two_shot_all_reduce_.default
        # fused copy-in (saves a kernel) and out-of-place two-shot (saves the copy back), where this torch has them
        self._one_copy = _optional_op(ops, "one_shot_all_reduce_copy_out")
        self._two_out = _optional_op(ops, "two_shot_all_reduce_out") if world_size in (2, 4, 8) else None

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether all_reduce sends ``x`` (a CUDA tensor) through this buffer rather than NCCL."""
        return x.numel() * x.element_size() <= self.two_shot_max and self.fits(x)

    def fits(self, x: torch.Tensor) -> bool:
        # Only properties every rank sees alike (shape, dtype, layout), so all ranks take the same path.
        # The kernels use 16-byte vectors where the size allows and need 4-byte multiples.
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype == self.dtype
            and 0 < nbytes <= self.buffer_bytes
            and nbytes % 4 == 0
            and x.is_contiguous()
            and (x.storage_offset() * x.element_size()) % 16 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() * x.element_size() <= self.one_shot_max:
            return self.one_shot(x)
        return self.two_shot(x)

    def method_for(self, x: torch.Tensor) -> str:
        """Which path all_reduce takes for ``x`` on a CUDA tensor ("one_shot", "two_shot" or "nccl")."""
        if not self.accepts(x):
            return "nccl"
        return "one_shot" if x.numel() * x.element_size() <= self.one_shot_max else "two_shot"

    def one_shot(self, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        flat = x.view(-1)
        view = self.buf[: flat.numel()]
        if self._one_copy is not None and fused is not False:
            # copies flat into this rank's buffer inside the kernel; each thread reads flat[i] before the
            # barrier and writes out[i] after it, so out may alias the local input
            self._one_copy(view, flat, "sum", self.group_name, flat)
        else:
            view.copy_(flat)
            self._one(view, "sum", self.group_name, flat)
        return x

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        view = self.buf[: flat.numel()]
        view.copy_(flat)
        if self._two_out is not None:
            self._two_out(view, "sum", self.group_name, flat)
        else:
            self._two(view, "sum", self.group_name)
            flat.copy_(view)
        return x

    def self_test(self, rank: int, world_size: int) -> str | None:
        """Run each kernel once eagerly (before any graph capture) on known data; None if all sums are exact."""
        itemsize = self.buf.element_size()
        sizes = sorted({min(4096, self.buf.numel()), min(1 << 19, self.buf.numel())})
        expected_base = sum(range(world_size))
        for numel in sizes:
            pattern = torch.arange(numel, device=self.buf.device) % 7
            for name in ("one_shot", "two_shot"):
                x = (pattern + rank).to(self.dtype)
                getattr(self, name)(x)
                want = (pattern * world_size + expected_base).to(self.dtype)
                if not torch.equal(x, want):
                    return f"{name} self-test at {numel * itemsize} bytes gave a wrong sum"
        torch.cuda.synchronize(self.buf.device)
        return None


class FusedAllReduceNorm:
    """The symmetric buffer of ``kernels.allreduce_norm`` (its own allocation, so its own signal pad), split in
    two halves that consecutive calls alternate between.

    Why two halves make an end-of-call barrier unnecessary: a rank writes half A again only two calls later,
    after passing the barrier of the call in between (on half B), which every peer reaches only after finishing
    the call that read half A (stream order; the kernel never overlaps its predecessor's memory accesses). The
    pattern breaks only if two calls on the same half follow each other with no call between, which happens at
    the boundary of two forwards; but every forward starts with the embedding's all-reduce, a collective that no
    rank completes before every rank has finished the previous forward. The ranks must make the same calls in
    the same order (they do: every decision here depends on shapes only)."""

    def __init__(self, buf: torch.Tensor, handle, rank: int, world_size: int, max_programs: int):
        self.buf, self.rank, self.world_size = buf, rank, world_size
        self.half_numel = buf.numel() // 2
        device = buf.device
        self.buf_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        pad_slots = int(getattr(handle, "signal_pad_size", 2048)) // 4  # int32 flags, one per (program, rank)
        self.max_programs = max(1, min(max_programs, pad_slots // world_size))
        self.calls = 0  # parity picks the half

    def fits(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            x.dim() == 2
            and x.dtype == self.buf.dtype
            and 0 < x.numel() <= self.half_numel
            and x.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))
        )

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        from kernels.allreduce_norm import allreduce_add_rmsnorm

        offset = (self.calls % 2) * self.half_numel
        self.calls += 1
        in_place = x.data_ptr() == self.buf[offset:].data_ptr()  # the projection wrote into our half already
        return allreduce_add_rmsnorm(
            x,
            residual,
            weight,
            eps,
            self.buf_ptrs,
            self.pad_ptrs,
            offset,
            self.rank,
            self.world_size,
            self.max_programs,
            copy_in=not in_place,
        )

    def next_input(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A [rows, cols] view of the half the next call will use, for the projection before it to write its
        partial sum into (saving the kernel's copy-in); None where that call would not take the fused path."""
        numel = rows * cols
        if dtype != self.buf.dtype or not 0 < numel <= self.half_numel:
            return None
        offset = (self.calls % 2) * self.half_numel
        return self.buf[offset : offset + numel].view(rows, cols)

    def self_test(self) -> str | None:
        """Eager first use (before any graph capture) on known data, both halves; None if the sums are exact."""
        hidden = 256
        weight = torch.ones(hidden, dtype=self.buf.dtype, device=self.buf.device)
        base = torch.arange(4 * hidden, device=self.buf.device).view(4, hidden) % 5
        for _ in range(2):
            x = (base + self.rank).to(self.buf.dtype)
            residual = torch.ones_like(x)
            _, res_out = self(x, residual, weight, 1e-6)
            want = (base * self.world_size + sum(range(self.world_size)) + 1).to(self.buf.dtype)
            if not torch.equal(res_out, want):
                return "fused all-reduce + RMSNorm self-test gave a wrong sum"
        torch.cuda.synchronize(self.buf.device)
        return None


def _optional_op(ops, name: str):
    try:
        return getattr(ops, name).default
    except (AttributeError, RuntimeError):
        return None


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
    reason = None
    if not settings().fused_all_reduce:
        reason = "NANOSERVE_FUSED_ALL_REDUCE=0"
    buf, fused = None, None
    if reason is None:
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
