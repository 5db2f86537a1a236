"""A MoE layer's front for decode batches of a few tokens, in one launch: the residual add and RMSNorm after
attention (kernels/fused.py ``rmsnorm``), the router's product and the routing (kernels/moe_routing.py ``route``).

Separately these are three kernels in a chain, and at one token each is a few microseconds of latency with nothing
to overlap (the gate/up GEMV behind them cannot load a weight before the experts are named). Here each of a few
programs loads its slice of the router's weight before the PDL wait, normalizes the tokens' rows itself (a few KB,
repeated by every program), writes its experts' logits, and takes a ticket; the program with the last ticket routes
every token from all the logits and resets the ticket for the next launch. Program 0 writes the normalized rows and
the residual stream. The arithmetic is theirs: the sum rounded to the model dtype, the norm as ``rmsnorm`` rounds
it, the logits rounded to the model dtype (the router is a 16-bit linear layer), the routing ``route_rows``'. CUDA
only (the ticket needs a GPU's atomics); tests run it in the interpreter, whose programs run one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused import rms_normalized
from kernels.moe_routing import route_rows
from kernels.pdl import pdl_enter, use_pdl

MAX_TOKENS = 4  # the rows a program normalizes and multiplies, unrolled (kernels/moe_decode.py MAX_TOKENS)
_EXPERTS_PER_PROGRAM = 8  # 32 KB of a 2,048-wide router in bf16 a program: 16 programs for 128 experts


@triton.jit(do_not_specialize=["num_tokens"])
def _norm_route_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    router_w_ptr,
    h_ptr,
    res_out_ptr,
    logits_ptr,
    weights_ptr,
    ids_ptr,
    ticket_ptr,
    num_tokens,
    stride_x,
    stride_r,
    stride_h,
    stride_ro,
    stride_rw,
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    T_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    experts = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = experts < E
    # the router's rows are parameters, written by no kernel of the step: in flight during the wait
    w_ptrs = router_w_ptr + experts[:, None].to(tl.int64) * stride_rw + offs_h[None, :]
    w = tl.load(w_ptrs, mask=mask_e[:, None] & mask_h[None, :], other=0.0)
    norm_w = tl.load(norm_w_ptr + offs_h, mask=mask_h, other=0.0)
    pdl_enter(USE_PDL)
    dtype = h_ptr.dtype.element_ty
    for t in tl.static_range(T_POW2):
        # row masks as tensors: the interpreter mis-types a scalar bool broadcast into a mask
        row_ok = (offs_h * 0 + t) < num_tokens
        m = mask_h & row_ok
        x = tl.load(x_ptr + t * stride_x + offs_h, mask=m, other=0.0)
        r = tl.load(res_ptr + t * stride_r + offs_h, mask=m, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        h = (rms_normalized(s, H, eps) * norm_w.to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(res_out_ptr + t * stride_ro + offs_h, s, mask=m)
            tl.store(h_ptr + t * stride_h + offs_h, h, mask=m)
        logits = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        e_ok = mask_e & ((experts * 0 + t) < num_tokens)
        tl.store(logits_ptr + t * E_POW2 + experts, logits.to(dtype), mask=e_ok)
    # every thread's logits stored before the ticket (release); the last ticket sees them all (acquire)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tokens = tl.arange(0, T_POW2)
        cols = tl.arange(0, E_POW2)
        token_ok = tokens < num_tokens
        # past L1 (.cg): it may hold an earlier launch's logits at these addresses
        all_logits = tl.load(
            logits_ptr + tokens[:, None] * E_POW2 + cols[None, :],
            mask=token_ok[:, None] & (cols[None, :] < E),
            other=-float("inf"),
            cache_modifier=".cg",
        )
        route_rows(
            all_logits.to(tl.float32), tokens, token_ok, weights_ptr, ids_ptr, E_POW2, TOP_K, K_POW2, RENORMALIZE
        )
        tl.store(ticket_ptr, 0)


def norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    ticket: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``x`` and ``residual`` [T <= MAX_TOKENS, H]: (rmsnorm(x + residual), x + residual, routing weights
    float32 [T, top_k], expert ids int32 [T, top_k]) with the router ``router_weight`` [E, H] (no bias).
    ``ticket``: an int32 [1] of zero, the caller's own (a CUDA graph replays its address); zero again after."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert 0 < num_tokens <= MAX_TOKENS and router_weight.shape[1] == hidden, (x.shape, router_weight.shape)
    assert x.stride(1) == residual.stride(1) == router_weight.stride(1) == 1
    assert ticket.dtype == torch.int32 and ticket.numel() == 1
    e_pow2 = triton.next_power_of_2(num_experts)
    h, res_out = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty(num_tokens, e_pow2, dtype=x.dtype, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    block_e = min(_EXPERTS_PER_PROGRAM, e_pow2)
    pdl = use_pdl(x)
    _norm_route_kernel[(triton.cdiv(num_experts, block_e),)](
        x,
        residual,
        norm_weight,
        router_weight,
        h,
        res_out,
        logits,
        weights,
        ids,
        ticket,
        num_tokens,
        x.stride(0),
        residual.stride(0),
        h.stride(0),
        res_out.stride(0),
        router_weight.stride(0),
        eps,
        H=hidden,
        BLOCK_H=triton.next_power_of_2(hidden),
        E=num_experts,
        E_POW2=e_pow2,
        BLOCK_E=block_e,
        T_POW2=triton.next_power_of_2(num_tokens),
        TOP_K=top_k,
        K_POW2=max(2, triton.next_power_of_2(top_k)),
        RENORMALIZE=renormalize,
        USE_PDL=pdl,
        num_warps=8 if x.is_cuda else 1,
        launch_pdl=pdl,
    )
    return h, res_out, weights, ids
