"""The two symmetric-memory reducers of tensor parallelism on CUDA, as comm/custom_all_reduce.py sets them up:
``SymmAllReduce`` (PyTorch's one-shot and two-shot ``symm_mem`` kernels over one rendezvoused buffer) and
``FusedAllReduceNorm`` (kernels/allreduce_norm.py's all-reduce + residual add + RMSNorm over its own buffer). Both
are kernels only once set up, safe to capture in CUDA graphs."""

from __future__ import annotations

import torch


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
