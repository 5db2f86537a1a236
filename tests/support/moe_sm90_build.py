"""Builds the MoE decode kernels (kernels/moe_decode.py) for an H100/H200 (sm_90a) on any machine, no GPU needed, in
the variants Qwen3-30B-A3B's layer launches (bf16, top-8 of 128 experts; the whole intermediate dim and one TP=4
rank's quarter), with the integer hints the JIT gives at run time; prints one line per kernel with ptxas's
registers and spills and exits non-zero if any fails to build.

    python -m tests.support.moe_sm90_build      (TRITON_INTERPRET must be unset)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from kernels import moe_decode

SM90 = GPUTarget("cuda", 90, 32)
HIDDEN, EXPERTS, TOP_K = 2048, 128, 8  # Qwen3-30B-A3B
INTERS = {"TP=1": 768, "TP=4": 192}


def build(fn, types: dict, constexprs: dict, num_warps: int) -> dict:
    """``fn`` built for sm_90a (pointers and integers not in ``types``: int32, 16-divisible as the JIT hints them),
    with ptxas -v's registers and spill stores, the shared memory, and whether the PDL wait is in place."""
    sig = {
        n: "constexpr" if n in constexprs else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
        for n in fn.arg_names
    }
    hints = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr"}
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=hints)
    kernel = triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": 1})
    ptxas = get_ptxas(90)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", report)
    return {
        "regs": int(re.search(r"Used (\d+) registers", report).group(1)),
        "spill": int(spill.group(1)) if spill else 0,
        "shared": kernel.metadata.shared,
        "pdl_wait": "griddepcontrol.wait" in kernel.asm["ptx"],
    }


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident programs an H100/H200 SM holds: registers go per warp in units of 256, 1 KB of shared memory is
    reserved per program (as benchmarks/probes/kernel_regs.py counts)."""
    warp_regs = -(-regs * 32 // 256) * 256
    return min(65536 // (warp_regs * warps), 228 * 1024 // (shared + 1024), 2048 // (32 * warps), 32)


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


def main() -> int:
    failed = 0
    for label, fn, types, constexprs, warps in cases():
        try:
            r = build(fn, types, constexprs, warps)
            r["per_sm"] = programs_per_sm(r["regs"], r["shared"], warps)
            print(
                f"ok      {label}: {r['regs']} registers, {r['spill']} B spilled, shared {r['shared']} B, "
                f"{r['per_sm']} programs an SM, pdl_wait={r['pdl_wait']}",
                flush=True,
            )
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAILED  {label}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
