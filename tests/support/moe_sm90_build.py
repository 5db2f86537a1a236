"""Builds the MoE decode kernels (kernels/moe_decode.py, kernels/moe_norm_route.py) for an H100/H200 (sm_90a) on
any machine, no GPU needed, in the variants Qwen3-30B-A3B's layer launches (bf16, top-8 of 128 experts; the whole
intermediate dim and one TP=4 rank's quarter; one and four tokens), with the integer hints the JIT gives at run
time; prints one line per kernel with ptxas's registers and spills and exits non-zero if any fails to build or
reads its operands a value at a time.

    python -m tests.support.moe_sm90_build      (TRITON_INTERPRET must be unset)
"""

from __future__ import annotations

import sys

from benchmarks.sm90_build import build_sm90, check_vector_loads, report_builds
from kernels import moe_decode, moe_norm_route

HIDDEN, EXPERTS, TOP_K = 2048, 128, 8  # Qwen3-30B-A3B
INTERS = {"TP=1": 768, "TP=4": 192}


def cases():
    bf16 = "*bf16"
    for label, inter in INTERS.items():
        t = moe_decode.decode_tiles(HIDDEN, inter, TOP_K)
        yield (
            f"gate/up {label} {t.block_i}x{t.block_h} warps={t.warps_gate_up}",
            moe_decode._gate_up_kernel,
            {"x_ptr": bf16, "w_ptr": bf16, "h_ptr": bf16},
            {"TOP_K": TOP_K, "BLOCK_I": t.block_i, "BLOCK_H": t.block_h, "EVEN_H": True, "USE_PDL": True},
            t.warps_gate_up,
        )
        yield (
            f"down {label} {TOP_K}x{t.block_n}x{t.block_k} warps={t.warps_down}",
            moe_decode._down_kernel,
            {"h_ptr": bf16, "w_ptr": bf16, "route_w_ptr": "*fp32", "out_ptr": bf16},
            {
                "TOP_K": TOP_K,
                "K_POW2": TOP_K,
                "BLOCK_N": t.block_n,
                "BLOCK_K": t.block_k,
                "EVEN_K": inter % t.block_k == 0,
                "USE_PDL": True,
            },
            t.warps_down,
        )


def front_cases():
    """kernels/moe_norm_route.py at one and four tokens."""
    bf16 = "*bf16"
    types = {name: bf16 for name in ("x_ptr", "res_ptr", "norm_w_ptr", "router_w_ptr", "h_ptr", "res_out_ptr")}
    types |= {"logits_ptr": bf16, "weights_ptr": "*fp32", "eps": "fp32"}
    for tokens in (1, 4):
        constexprs = {"H": HIDDEN, "BLOCK_H": HIDDEN, "E": EXPERTS, "E_POW2": EXPERTS, "BLOCK_E": 8, "T_POW2": tokens}
        constexprs |= {"TOP_K": TOP_K, "K_POW2": TOP_K, "RENORMALIZE": True, "USE_PDL": True}
        yield f"norm+route tokens={tokens} warps=8", moe_norm_route._norm_route_kernel, types, constexprs, 8


def describe(fn, types: dict, constexprs: dict, warps: int) -> str:
    r = build_sm90(fn, types, constexprs, warps)
    check_vector_loads(r["ptx"])
    return (
        f": {r['regs']} registers, {r['spill']} B spilled, shared {r['smem']} B, {r['per_sm']} programs an SM, "
        f"pdl_wait={'griddepcontrol.wait' in r['ptx']}"
    )


def main() -> int:
    return report_builds([*cases(), *front_cases()], describe)


if __name__ == "__main__":
    sys.exit(main())
