"""Compiles the fused MoE kernels for an H200 (sm_90) on any machine, as a launch on 16-byte aligned tensors would
specialize them, and prints one JSON line describing each compiled kernel (tests/test_fused_moe.py reads it).
Run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled."""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import moe_routing as mr
from kernels.fused_moe import _moe_gemm_kernel, moe_tiles


def compile_sm90(fn, signature: dict, constexprs: dict, aligned: list[str], **options) -> dict:
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(
        fn=fn, signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs, attrs=attrs
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {
        "kernel": fn.__name__,
        "shared": kernel.metadata.shared,
        "cp_async": "cp.async" in ptx,
        "wgmma": "wgmma" in ptx,
        "pdl_wait": "griddepcontrol.wait" in ptx,
        "atomics": "atom.global" in ptx,
        "barrier": "bar.sync" in ptx,
    }


def gemms() -> list[dict]:
    rows = []
    ptrs = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "route_w_ptr": "*fp32"}
    ptrs |= dict.fromkeys(("sorted_ptr", "block_expert_ptr", "num_rows_ptr"), "*i32")
    sizes = ["N", "K", "stride_am", "stride_we", "stride_wn", "stride_om"]
    sig = ptrs | dict.fromkeys([*sizes, "num_pairs", "max_blocks_m"], "i32")
    for tokens in (1, 256, 8192):  # the three row blocks a Qwen3-30B-A3B layer (128 experts, top-8) gets
        t = moe_tiles(tokens, 8, 128, torch.bfloat16)
        for gated in (True, False):
            consts = dict(A_ROWS_PER_PAIR=8 if gated else 1, GATED=gated, SCALE_BY_ROUTE=not gated, EVEN_K=True)
            consts |= dict(IEEE=False, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m)
            row = compile_sm90(
                _moe_gemm_kernel,
                sig,
                consts | {"USE_PDL": True},
                [*ptrs, *sizes],
                num_warps=t.num_warps,
                num_stages=t.num_stages,
            )
            rows.append(row | {"block_m": t.block_m, "gated": gated})
    return rows


def routing() -> list[dict]:
    bins = triton.next_power_of_2(128 + 1)
    route = dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i32", num_tokens="i32", stride_l="i32")
    consts = dict(E=128, E_POW2=128, TOP_K=8, K_POW2=8, RENORMALIZE=True, BLOCK_T=32, USE_PDL=True)
    rows = [compile_sm90(mr._route_kernel, route, consts, ["logits_ptr", "weights_ptr", "ids_ptr"])]
    names = ["ids_ptr", "sorted_ptr", "block_expert_ptr", "num_rows_ptr", "cursor_ptr"]
    sig = dict.fromkeys(names, "*i32") | dict(num_pairs="i32", E="i32")
    consts = dict(E_POW2=bins, BLOCK_P=mr.ONE_PROGRAM_BLOCK, BLOCK_M=16, USE_PDL=True)
    rows.append(compile_sm90(mr._group_one_program_kernel, sig, consts, names, num_warps=8))
    sig = dict(ids_ptr="*i32", counts_ptr="*i32", num_pairs="i32", E="i32")
    rows.append(compile_sm90(mr._count_chunks_kernel, sig, dict(E_POW2=bins, CHUNK=mr.CHUNK_PAIRS), list(sig)[:2]))
    names = ["counts_ptr", "sorted_ptr", "block_expert_ptr", "num_rows_ptr"]
    sig = dict.fromkeys(names, "*i32") | dict(num_chunks="i32", num_pairs="i32", E="i32")
    rows.append(compile_sm90(mr._chunk_offsets_kernel, sig, dict(E_POW2=bins, BLOCK_M=64), names))
    sig = dict(ids_ptr="*i32", cursor_ptr="*i32", sorted_ptr="*i32", num_pairs="i32")
    rows.append(compile_sm90(mr._scatter_chunks_kernel, sig, dict(E_POW2=bins, CHUNK=mr.CHUNK_PAIRS), list(sig)[:3]))
    return rows


if __name__ == "__main__":
    print(json.dumps(gemms() + routing()))
