"""All-reduce fused with the residual add and RMSNorm that follow every row-parallel projection (o_proj,
down_proj), over peer-mapped (symmetric) buffers on the GPUs of one host.

Unfused, a decode step under tensor parallelism runs per projection: a copy into the symmetric buffer, the
all-reduce kernel (two barriers), and the add + RMSNorm kernel, ~25 us at batch 256 on two H200s, 72 times a
step. Here one kernel does it all, "one-shot": each program copies its rows of this rank's partial sum into this
rank's buffer (unless the projection wrote them there: ``COPY_IN``), meets the same program of every peer at a
barrier, reads its rows from every rank's buffer (over NVLink), sums them in rank order (so every rank gets
bit-identical results), then adds the residual and normalizes as ``fused._rmsnorm_kernel`` does (same rounding).

No barrier at the end: the caller alternates between two halves of the buffer, so a rank only rewrites a half
after every peer has passed a later barrier, i.e. has finished reading that half (see ``comm.custom_all_reduce``).

The barrier is per program: program p of rank r sets flag [p, r] in each peer's signal pad (compare-and-swap 0->1,
release, system scope; it spins while the peer still holds the previous 1) and waits to take flag [p, q] in its own
pad back to 0 (acquire) for each peer q. Flags return to zero, so graphs can replay it. All programs of the grid
must be resident at once (the caller keeps the grid to a few programs per SM), or a rank's waiting programs could
starve the ones its peer waits for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl


# rows changes every step: not specialized (a prefill step of an odd token count compiled a variant mid-run)
@triton.jit(do_not_specialize=["rows"])
def _allreduce_add_rmsnorm_kernel(
    x_ptr,  # this rank's partial sum [rows, N]
    res_ptr,  # residual [rows, N] (unused unless HAS_RESIDUAL)
    w_ptr,
    out_ptr,
    res_out_ptr,
    buf_ptrs,  # int64 [WORLD]: every rank's symmetric buffer (the same allocation, mapped)
    pad_ptrs,  # int64 [WORLD]: every rank's signal pad
    buf_offset,  # elements: which half of the buffer this call uses
    rows,
    N,
    eps,
    rank,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    COPY_IN: tl.constexpr,  # False: x already is this rank's buffer half (the projection wrote it there)
    ROWS: tl.constexpr,  # rows per tile: more loads in flight per program
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)[None, :]
    col_ok = cols < N
    dtype = x_ptr.dtype.element_ty
    own = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)) + buf_offset
    if COPY_IN:
        for row0 in range(pid * ROWS, rows, nprog * ROWS):
            r = row0 + tl.arange(0, ROWS)[:, None]
            mask = (r < rows) & col_ok
            idx = r.to(tl.int64) * N + cols
            tl.store(own + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's copy is issued before the release below
    my_pad = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != rank:
            peer_pad = tl.load(pad_ptrs + q).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(peer_pad + pid * WORLD + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    for q in tl.static_range(WORLD):
        if q != rank:
            while tl.atomic_cas(my_pad + pid * WORLD + q, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads a peer's rows before the acquire above
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    for row0 in range(pid * ROWS, rows, nprog * ROWS):
        r = row0 + tl.arange(0, ROWS)[:, None]
        mask = (r < rows) & col_ok
        idx = r.to(tl.int64) * N + cols
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            src = tl.load(buf_ptrs + q).to(tl.pointer_type(dtype)) + buf_offset
            acc += tl.load(src + idx, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        x = acc.to(dtype)  # the all-reduce's result, rounded as NCCL's would be
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + idx, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + idx, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / N + eps)
        y = (xf * rstd[:, None]).to(dtype).to(tl.float32) * w
        tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=mask)


def allreduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    buf_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    buf_offset: int,
    rank: int,
    world: int,
    max_programs: int,
    copy_in: bool = True,
    rows_per_tile: int | None = None,
    num_warps: int | None = None,
):
    """norm(sum over ranks of ``x`` [+ residual]) for a contiguous 2-D ``x``; returns (out, new residual) with a
    residual, else out. The caller guarantees that every rank calls with the same shapes in the same order, and
    with ``copy_in=False`` that ``x`` is this rank's buffer half at ``buf_offset``."""
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    if rows_per_tile is None:  # at most 2 rows per program's pass; more programs before more rows per tile
        rows_per_tile = 2 if rows > 2 * max_programs else 1
    if num_warps is None:
        num_warps = 4 if block * rows_per_tile <= 2048 else 8
    pdl = use_pdl(x)
    grid = max(1, min(triton.cdiv(rows, rows_per_tile), max_programs))
    _allreduce_add_rmsnorm_kernel[(grid,)](
        x,
        res,
        weight,
        out,
        res_out,
        buf_ptrs,
        pad_ptrs,
        buf_offset,
        rows,
        n,
        eps,
        rank,
        WORLD=world,
        HAS_RESIDUAL=residual is not None,
        COPY_IN=copy_in,
        ROWS=rows_per_tile,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return out if residual is None else (out, res_out)
