"""Builds the FP8 kernels for an H100/H200 (sm_90a) on any machine, no GPU needed (``triton.compile`` for the target,
as benchmarks/sm90_build.py does): the activation quantization, the FP8 GEMM and GEMV in the variants fp8_linear
launches, the fused MLP middle, the RMSNorm that quantizes its row, and the attention kernels on an e4m3 cache.
Prints one line per kernel and exits non-zero if any fails to build or reads its operands a value at a time.

    python -m tests.support.fp8_sm90_build      (TRITON_INTERPRET must be unset)
"""

from __future__ import annotations

import sys

import torch

from benchmarks.sm90_build import MAX_SUBWORD_LOADS, build_sm90, check_vector_loads, report_builds
from kernels import (
    attention_decode,
    attention_prefill,
    attention_store,
    fp8_gemm,
    fp8_gemv,
    fp8_mlp,
    fp8_quant,
    fp8_rescale,
    fused,
    qk_norm_rope,
    split_sums,
)

FP8, BF16, F32 = "*fp8e4nv", "*bf16", "*fp32"
# value_cache's layout: K's head_dim stride and V's slot stride are 1, which the JIT specializes as constants
V_KEYS_STRIDES = {("k_strides", 3): 1, ("v_strides", 1): 1}


def build(
    fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 1, subword_loads: int = MAX_SUBWORD_LOADS
) -> int:
    """Shared memory of ``fn`` built for sm_90a (benchmarks/sm90_build.py's ``build_sm90``); raises if the
    build reads values one at a time (more than ``subword_loads`` scalar 8/16-bit loads: ``check_vector_loads``)."""
    r = build_sm90(fn, types, constexprs, num_warps, num_stages, registers=False)
    check_vector_loads(r["ptx"], subword_loads)
    return r["smem"]


def cases():
    for group, block in ((0, 4096), (128, 16384)):
        yield (
            f"activation quantization group={group}",
            fp8_quant._quant_rows_kernel,
            {"x_ptr": BF16, "q_ptr": FP8, "s_ptr": F32},
            {"GROUP": group, "BLOCK": block, "USE_PDL": True},
            {"num_warps": 4 if block <= 4096 else 16},
        )
    gemm = {"w_ptr": FP8, "xs_ptr": F32, "ws_ptr": F32, "bias_ptr": BF16, "x_ptr": FP8}
    for blocks in (False, True):
        for split, (bm, bn, warps) in ((4, (16, 64, 4)), (1, (16, 64, 4)), (1, (128, 128, 8))):
            yield (
                f"fp8 gemm block_scales={blocks} split={split} {bm}x{bn}",
                fp8_gemm._fp8_gemm_kernel,
                dict(gemm, out_ptr=F32 if split > 1 else BF16),
                {
                    "BLOCK_SCALES": blocks,
                    "GROUP_N": 128 if blocks else 1,
                    "GROUP_K": 128,
                    "BLOCK_M": bm,
                    "BLOCK_N": bn,
                    "BLOCK_K": 128,
                    "SPLIT_K": split,
                    "HAS_BIAS": False,
                    "USE_PDL": True,
                },
                {"num_warps": warps, "num_stages": 3},
            )
    for group_n, k, rows, f16_sums, quantized in ((0, 4096, 1, False, False), (0, 4096, 1, True, False),
                                                  (0, 12288, 4, False, False), (128, 4096, 2, False, False),
                                                  (128, 12288, 1, False, False), (0, 4096, 1, False, True),
                                                  (0, 12288, 1, False, True)):  # fmt: skip
        block = None if group_n == 0 else (128, 128)
        x_dtype = torch.float8_e4m3fn if quantized else torch.bfloat16
        block_n, block_k = fp8_gemv.gemv_tiles(k, block, *fp8_gemv.default_tiling(x_dtype, k, block))
        yield (
            f"fp8 gemv group_n={group_n} K={k} rows={rows} f16_sums={f16_sums} x_quantized={quantized}",
            fp8_gemv._fp8_gemv_kernel,
            {"x_ptr": FP8 if quantized else BF16, "w_ptr": FP8, "ws_ptr": F32, "bias_ptr": BF16, "out_ptr": BF16}
            | {"xs_ptr": F32},
            {
                "X_QUANTIZED": quantized,
                "K": k,
                "ROWS": rows,
                "BLOCK_N": block_n,
                "BLOCK_K": block_k,
                "GROUP_N": group_n,
                "GROUP_K": 128 if group_n else 1,
                "HAS_BIAS": True,
                "F16_SUMS": f16_sums,
                "USE_PDL": True,
            },
            {"num_warps": 8},
        )
    for scaled in (False, True):  # scaled: its input an FP8 product before its scales (model/fp8_folded.py)
        yield (
            f"add + RMSNorm quantizing its row, scaled={scaled}",
            fused._rmsnorm_kernel,
            {"x_ptr": BF16, "res_ptr": BF16, "w_ptr": BF16, "out_ptr": FP8, "res_out_ptr": BF16, "scale_ptr": F32}
            | {"xs_ptr": F32, "ws_ptr": F32, "eps": "fp32"},
            {"HAS_RESIDUAL": True, "QUANTIZE": True, "SCALED": scaled, "BLOCK": 4096, "USE_PDL": True},
            {"num_warps": 16},
        )
    yield (
        "rescale after a scalar-scaled product",
        fp8_rescale._rescale_kernel,
        {"out_ptr": BF16, "xs_ptr": F32, "ws_ptr": F32, "bias_ptr": BF16},
        {"BLOCK_N": 1024, "ROWS": 4, "HAS_BIAS": True, "USE_PDL": True},
        {},
    )
    # a whole Qwen3-8B row (8,192 + 4,096 columns), 2 rows a program; a wider one's steps; a finished one-row product
    middles = ((8192, 4096, 2, 16, True), (2048, 0, 1, 4, True), (16384, 0, 1, 32, False))
    for block, tail, rows, warps, scaled in middles:
        yield (
            f"scales + SiLU-and-mul + quantization of an MLP block={block}+{tail} rows={rows} scaled={scaled}",
            fp8_mlp._silu_mul_quant_kernel,
            {"y_ptr": BF16, "xs_ptr": F32, "ws_ptr": F32, "bias_ptr": BF16, "q_ptr": FP8, "s_ptr": F32},
            {"HAS_BIAS": scaled, "SCALED": scaled, "ROWS": rows, "BLOCK": block, "TAIL": tail}
            | {"ONE_STEP": block + tail >= 12288, "USE_PDL": True},
            {"num_warps": warps},
        )
    yield (
        "split-K sum",
        split_sums._sum_splits_kernel,
        {"part_ptr": F32, "bias_ptr": BF16, "out_ptr": BF16},
        {"SPLIT_K": 4, "BLOCK": 1024, "HAS_BIAS": True, "USE_PDL": True},
        {},
    )
    attn = {
        "q_ptr": BF16,
        "k_cache_ptr": FP8,
        "v_cache_ptr": FP8,
        "qk_scale": "fp32",
        "v_scale": "fp32",
        "lse_ptr": F32,
    }
    yield (
        "KV store into e4m3",
        attention_store._store_kvcache_kernel,
        {"k_ptr": BF16, "v_ptr": BF16, "k_cache_ptr": FP8, "v_cache_ptr": FP8, "slot_ptr": "*i64"}
        | {"inv_k_scale": "fp32", "inv_v_scale": "fp32"},
        {"PAGE": 16, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "KV_FP8": True, "USE_PDL": True}
        | V_KEYS_STRIDES,
        {},
    )
    yield (
        "prefill over e4m3",
        attention_prefill._prefill_kernel,
        dict(attn, out_ptr=BF16),
        {"GROUP": 4, "PAGE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 64, "BLOCK_N": 64}
        | {"DOT_F16": True, "V_KEYS": True, "USE_PDL": True}
        | V_KEYS_STRIDES,
        {"num_stages": 2},
    )
    # the group as M in 4-warp tiles, the keys as M in one-warp ones (split_decode)
    for keys_m, (direct, block_n) in [
        (False, (True, 128)),
        (False, (False, 64)),
        (True, (True, 16)),
        (True, (False, 16)),
    ]:
        yield (
            f"split decode over e4m3 direct={direct}" + (", keys as M" if keys_m else ""),
            attention_decode._decode_split_kernel,
            dict(attn, out_ptr=BF16 if direct else F32),
            {"GROUP": 4, "PAGE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 8 if keys_m else 16}
            | {"BLOCK_N": block_n, "DIRECT_OUT": direct, "HEADS_FIRST": True, "DOT_F16": True, "V_KEYS": True}
            | {"KEYS_M": keys_m, "USE_PDL": True}
            | V_KEYS_STRIDES,
            {"num_warps": 1 if keys_m else 4, "num_stages": 2},
        )
    # blocks: programs of 8 heads
    for scaled, blocks in ((False, False), (True, False), (False, True), (True, True)):
        yield (
            f"qk norm + RoPE + KV store into e4m3, scaled={scaled} head_blocks={blocks}",
            qk_norm_rope._qk_norm_rope_kernel,
            {"x_ptr": BF16, "wq_ptr": BF16, "wk_ptr": BF16, "cos_sin_ptr": F32, "pos_ptr": "*i64", "v_ptr": BF16}
            | {"k_cache_ptr": FP8, "v_cache_ptr": FP8, "slot_ptr": "*i64", "xs_ptr": F32, "ws_ptr": F32}
            | {"eps": "fp32", "inv_k_scale": "fp32", "inv_v_scale": "fp32"},
            {
                "PAGE": 16,
                "NUM_Q_HEADS": 32,
                "NUM_HEADS": 40,
                "HALF": 64,
                "BLOCK_H": 8 if blocks else 64,
                "BLOCK_V": 8,
                "V_INLINE": not blocks,
                "HAS_NORM": True,
                "STORE_KV": True,
                "KV_FP8": True,
                "SCALED": scaled,
                "USE_PDL": True,
            }
            | V_KEYS_STRIDES,
            # Triton 3.6 (the H200 image's) broadcasts the 1-D cos/sin and norm weights into an 8-head tile through
            # shared memory: 16-20 two-byte loads a thread, each a value that thread uses (Triton 3.9: none)
            {"num_warps": 2 if blocks else 8, "subword_loads": 20 if blocks else MAX_SUBWORD_LOADS},
        )


def main() -> int:
    return report_builds(cases(), lambda *case: f" (shared memory {build(*case[:3], **case[3])} B)")


if __name__ == "__main__":
    sys.exit(main())
