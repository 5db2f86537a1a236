"""How many split-decode programs fit on an sm_90a SM, per tiling? Registers, spills, shared memory and programs per
SM of the engine's split decode kernel (kernels/attention_decode.py), built for an H100/H200 on any machine, no GPU
needed (benchmarks/sm90_build.py). Answered for Triton 3.6 in docs/PERFORMANCE_LOG.md log 14e; re-run it after
changing a decode kernel. It lives in tests/support, not benchmarks/, because it builds the kernel's private JIT
function (benchmarks/probes/kernel_regs.py until 2026-12-07).

    python -m tests.support.decode_regs [--tiles 64,4,2 ...] [--kv-fp8] [--keys-m]      (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import argparse

from benchmarks.sm90_build import build_sm90
from kernels import attention_decode

HALF_PTRS = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"}
FLOAT_PTRS = {"lse_ptr"}


def compile_sm90(
    fn,
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    maxnreg: int | None = None,
    float_ptrs=FLOAT_PTRS,
    kv_fp8: bool = False,
) -> dict:
    """``build_sm90`` for the attention kernels: pointers in ``float_ptrs`` fp32, the others in HALF_PTRS bf16 (the
    cache's in e4m3 with ``kv_fp8``)."""
    types = {name: "*fp32" if name in float_ptrs else "*bf16" for name in (*HALF_PTRS, *float_ptrs)}
    if kv_fp8:
        types |= {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    return build_sm90(fn, types | {"qk_scale": "fp32"}, constexprs, num_warps, num_stages, maxnreg)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--tiles",
        nargs="+",
        default=["64,4,2", "128,4,2", "64,8,2", "128,8,2"],
        help="keys,warps,stages[,max registers a thread]",
    )
    parser.add_argument("--kv-fp8", action="store_true", help="an e4m3 cache (V keys-contiguous), as the engine's")
    parser.add_argument("--keys-m", action="store_true", help="stage 1 with the keys as the dots' M (one warp)")
    args = parser.parse_args()
    tilings = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    common = dict(GROUP=4, PAGE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=8 if args.keys_m else 16, USE_PDL=True)
    common |= dict(DOT_F16=args.kv_fp8, V_KEYS=args.kv_fp8)
    common |= {"KEYS_M": args.keys_m, ("k_strides", 3): 1}  # K's head_dim stride is 1, a constant to the JIT
    if args.kv_fp8:  # keys-contiguous V: its key stride is 1, which the JIT specializes as a constant
        common |= {("v_strides", 1): 1}
    else:
        common |= {("v_strides", 3): 1}
    split = attention_decode._decode_split_kernel
    print(f"{'kernel':38s} {'tiles':>10s} {'regs':>5s} {'spill B':>8s} {'smem KB':>8s} {'per SM':>7s}")
    for block_n, warps, stages, *cap in tilings:
        for direct in (True, False):
            consts = {**common, "BLOCK_N": block_n, "DIRECT_OUT": direct, "HEADS_FIRST": True}
            consts = {k: v for k, v in consts.items() if (k if isinstance(k, str) else k[0]) in split.arg_names}
            # several splits write fp32 partials through out_ptr; one split writes the bf16 output
            float_ptrs = FLOAT_PTRS if direct else FLOAT_PTRS | {"out_ptr"}
            r = compile_sm90(split, consts, warps, stages, cap[0] if cap else None, float_ptrs, args.kv_fp8)
            label = "split decode, " + ("one split" if direct else "several")
            tiles = ",".join(map(str, (block_n, warps, stages, *cap)))
            print(f"{label:38s} {tiles:>10s} {r['regs']:5d} {r['spill']:8d} {r['smem'] / 1024:8.1f} {r['per_sm']:7d}")


if __name__ == "__main__":
    main()
