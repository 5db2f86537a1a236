"""A Triton kernel built for an H100/H200 (sm_90a) on any machine, no GPU needed: ``triton.compile`` for the target
with the integer hints the JIT gives at run time (16-divisible strides), then ``ptxas -v`` (shipped with Triton)
for its registers, spills, shared memory and the programs an SM holds; and a check that the build loads its
operands in vectors, not a value at a time.

The build checks in tests/support use it (fp8_sm90_build.py, moe_sm90_build.py, and decode_regs.py: the split
decode kernel's registers per tiling). ``launch_builds`` builds what a host launcher launches instead, with the JIT's
own specialization of its real arguments, and ``sass_profile`` counts the SASS (attention_sm90_build.py).
Why it matters: a memory-bound kernel's speed follows how many of its programs an SM holds at once (a stream decode
that needed 168 registers where the split decode needs 118 held 3 programs per SM instead of 4 and lost,
docs/PERFORMANCE_LOG.md log 14e). The local Triton may differ from the device's: install that version to a separate
target and put it first on PYTHONPATH to count for the device.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM, PROGRAMS_PER_SM = 65536, 228 * 1024, 2048, 32
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
    return out | _ptxas_report(out["ptx"], out["smem"], num_warps) if registers else out


def _ptxas_report(ptx_text: str, smem: int, num_warps: int) -> dict:
    """``ptxas -v``'s registers and spill stores for ``ptx_text``, and the programs an SM holds."""
    ptxas = get_ptxas(90)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ptx_text)
        cmd = [getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = re.search(r"(\d+) bytes spill stores", report)
    warp_regs = -(-regs * 32 // 256) * 256  # registers are handed out per warp in units of 256
    fit = min(
        REGS_PER_SM // (warp_regs * num_warps),
        SMEM_PER_SM // (smem + 1024),  # the driver reserves 1 KB of shared memory per program
        THREADS_PER_SM // (32 * num_warps),
        PROGRAMS_PER_SM,
    )
    return {"regs": regs, "spill": int(spill.group(1)) if spill else 0, "per_sm": fit}


def launch_builds(kernels: dict, launch, overrides: dict | None = None) -> dict:
    """Run ``launch()`` (a host launcher over tensors of any device, "meta" included) with each JIT function in
    ``kernels`` (a label each) built for sm_90a instead of launched: its specialization comes from the JIT's own
    binder over the launch's real arguments (divisibility hints, unit strides as constants, tuples element by
    element), so the build is the one a launch on an H100 compiles, not one from assumed hints. ``overrides``
    (e.g. ``USE_PDL``/``launch_pdl``, which a CPU tensor turns off) replace launch keywords the kernel takes.
    Returns {label: build_sm90's dict + "sass" and the specialization: "hinted" (argument paths with the
    16-divisibility hint) and "constants" ({path: value})}; the last launch of a kernel wins."""
    backend, builds, saved = CUDABackend(SM90), {}, {}

    def capture(label, fn):
        def run(*args, grid, warmup, **kwargs):
            names = {p.name for p in fn.params} | {"num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg"}
            kwargs |= {k: v for k, v in (overrides or {}).items() if k in names}
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, options = binder(*args, **kwargs)
            # what JITFunction.run does before it compiles (Triton 3.6-3.9; a private method of Triton's)
            options, sig, consts, attrs = JITFunction._pack_args(fn, backend, kwargs, bound, spec, options)
            kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=SM90, options=options.__dict__)
            out = {"ptx": kernel.asm["ptx"], "smem": kernel.metadata.shared, "sass": _sass(kernel.asm["cubin"])}
            out |= _ptxas_report(out["ptx"], out["smem"], options.num_warps)
            out |= {"hinted": {path for path, a in attrs.items() if ["tt.divisibility", 16] in a}}
            builds[label] = out | {"constants": consts, "arg_names": fn.arg_names}

        return run

    try:
        for label, fn in kernels.items():
            saved[label] = fn.__dict__.get("run")
            fn.run = capture(label, fn)
        launch()
    finally:
        for label, fn in kernels.items():
            if saved[label] is None:
                del fn.run
            else:
                fn.run = saved[label]
    return builds


def _sass(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(getattr(get_ptxas(90), "path", get_ptxas(90))), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout


def sass_profile(sass: str) -> dict:
    """Counts of a build's SASS: "instrs" in all; "loop" in its longest loop (a backward branch's body: a tile
    loop's cost per iteration); global loads ("ldg"), async copies into shared memory ("ldgsts") and global stores
    ("stg"), each with how many move 16 bytes ("ldg_wide", ...); "subword" global loads of 1-2 bytes; "imad_wide"
    64-bit multiply-adds (address math)."""
    ins = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", sass)]
    loop = 0
    for addr, op in ins:
        if (m := re.search(r"\bBRA\s+0x([0-9a-f]+)", op)) and int(m[1], 16) < addr:
            loop = max(loop, sum(1 for a, _ in ins if int(m[1], 16) <= a <= addr))
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for _, op in ins]
    out = {"instrs": len(ins), "loop": loop, "imad_wide": sum(o.startswith("IMAD.WIDE") for o in opcodes)}
    for kind in ("ldg", "ldgsts", "stg"):
        ops = [o for o in opcodes if o.startswith(kind.upper() + ".")]
        out |= {kind: len(ops), kind + "_wide": sum(o.endswith(".128") for o in ops)}
    out["subword"] = sum(o.startswith("LDG.") and o.endswith((".U8", ".S8", ".U16", ".S16")) for o in opcodes)
    return out


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
