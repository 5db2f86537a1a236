"""How many decode-attention programs fit on an sm_90a SM? Answered for Triton 3.6 in docs/PERFORMANCE_LOG.md log 14e.

Registers, spills, shared memory and programs per SM of our split decode kernel on an H100/H200, computed on any
machine, no GPU needed: ``triton.compile`` for the target with the integer hints the JIT gives at run time
(16-divisible strides), then ``ptxas -v`` (shipped with Triton).

    python -m benchmarks.probes.kernel_regs [--tiles 64,4,2 ...] [--kv-fp8] [--keys-m]

Why: a memory-bound kernel's speed follows how many of its programs an SM holds at once (a stream decode that
needed 168 registers where the split decode needs 118 held 3 programs per SM instead of 4 and lost). Re-run it
after changing a decode kernel. The local Triton may differ from the device's (3.6): install that version to a
separate target and put it first on PYTHONPATH to count for the device.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from kernels import attention_decode

SM90 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM, PROGRAMS_PER_SM = 65536, 228 * 1024, 2048, 32
HALF_PTRS = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"}
FLOAT_PTRS = {"lse_ptr"}
CACHE_STRIDES = {"k_strides": ("i32",) * 4, "v_strides": ("i32",) * 4}  # the KV kernels' page_strides tuples


def build_sm90(
    fn,
    types: dict,
    constexprs: dict,
    num_warps: int = 4,
    num_stages: int = 1,
    maxnreg: int | None = None,
    registers: bool = True,
) -> dict:
    """Compile ``fn`` for sm_90a as a launch would specialize it: argument types from ``types`` (pointers not named
    there int32, scalars int32, CACHE_STRIDES's tuples), and every pointer and integer the kernel does not exempt
    (``do_not_specialize``) with the 16-divisibility hint the JIT gives such values at run time. A key of
    ``constexprs`` is a name, or (name, index) for an element of a tuple. Returns the PTX and shared memory and,
    with ``registers``, ``ptxas -v``'s registers and spill stores and the programs an SM holds."""
    unhinted = {p.name for p in fn.params if p.do_not_specialize}
    types = CACHE_STRIDES | types
    sig = {
        name: "constexpr" if name in constexprs else types.get(name, "*i32" if name.endswith("_ptr") else "i32")
        for name in fn.arg_names
    }
    consts = {
        (fn.arg_names.index(k),) if isinstance(k, str) else (fn.arg_names.index(k[0]), k[1]): v
        for k, v in constexprs.items()
    }
    hints = {}
    for i, name in enumerate(fn.arg_names):
        if isinstance(sig[name], tuple):  # a constant element is typed constexpr, as the JIT types a 1
            sig[name] = tuple("constexpr" if (i, j) in consts else t for j, t in enumerate(sig[name]))
            paths = [((i, j), t) for j, t in enumerate(sig[name])]
        else:
            paths = [((i,), sig[name])]
        hints |= {
            path: [["tt.divisibility", 16]]
            for path, ty in paths
            if ty not in ("constexpr", "fp32") and name not in unhinted
        }
    kernel = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=hints),
        target=SM90,
        options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg},
    )
    out = {"ptx": kernel.asm["ptx"], "smem": kernel.metadata.shared}
    if not registers:
        return out
    ptxas = get_ptxas(90)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = re.search(r"(\d+) bytes spill stores", report)
    warp_regs = -(-regs * 32 // 256) * 256  # registers are handed out per warp in units of 256
    fit = min(
        REGS_PER_SM // (warp_regs * num_warps),
        SMEM_PER_SM // (out["smem"] + 1024),  # the driver reserves 1 KB of shared memory per program
        THREADS_PER_SM // (32 * num_warps),
        PROGRAMS_PER_SM,
    )
    return out | {"regs": regs, "spill": int(spill.group(1)) if spill else 0, "per_sm": fit}


# the most scalar 8/16-bit global or shared loads the build checks accept in a kernel: the KV store's 8 (a token's V
# bytes transposed into value_cache's layout, once per token) pass; the 128-192 of a value-at-a-time tile loop fail
MAX_SUBWORD_LOADS = 8


def subword_loads(ptx: str) -> int:
    """Scalar 8- and 16-bit global and shared load instructions in ``ptx``. A kernel with many reads its operands a
    value at a time: from global memory most often because a size the JIT was told not to specialize hides the
    alignment of its masks (docs/PERFORMANCE_LOG.md log 24f: the rescale's 2-byte and the FP8 GEMM's 1-byte loads);
    from shared memory when an 8-bit dot operand needs a transpose (log 25: V of an e4m3 cache in [keys, D] tiles)."""
    loads = re.findall(r"\bld\.(?:global|shared)[\w.]*", ptx)
    return sum(1 for op in loads if ".v" not in op and op.endswith(("8", "16")))


def check_vector_loads(ptx: str, limit: int = MAX_SUBWORD_LOADS) -> None:
    """Raise if ``ptx`` has more than ``limit`` scalar 8/16-bit loads (the build scripts' check)."""
    if (n := subword_loads(ptx)) > limit:
        raise RuntimeError(
            f"{n} scalar 8/16-bit loads in the PTX (an unspecialized size hiding alignment, or a byte-wise transpose?)"
        )


def report_builds(cases, describe) -> int:
    """Build every case (a label, then ``describe``'s arguments) for sm_90a: one "ok" line each with what
    ``describe`` returns, or a "FAILED" line; 1 if any failed (the build-check scripts' exit status)."""
    failed = 0
    for label, *args in cases:
        try:
            print(f"ok      {label}{describe(*args)}", flush=True)
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAILED  {label}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


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
