"""Triton's CPU interpreter (TRITON_INTERPRET=1, Triton 3.4-3.6) rounds float -> e4m3 conversions without carrying a
rounded-up mantissa into the exponent (124.3 becomes 64, not 128), unlike the GPU's ``cvt.rn.satfinite``. Tests of
kernels that write e4m3 call ``fix_interpreter_fp8_rounding`` so the interpreter converts as the GPU does (round to
nearest even, saturating at 448; torch's CPU conversion), and the kernels themselves stay exactly the GPU code."""

from __future__ import annotations

import numpy as np
import torch


def fix_interpreter_fp8_rounding() -> None:
    from triton.language import core as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_nanoserve_original_convert", None)
    if original is not None:
        return
    original = interpreter._convert_float
    sources = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in sources:
            return original(data, input_dtype, output_dtype, rounding_mode)
        raw = torch.from_numpy(np.ascontiguousarray(data).copy())
        src = raw.view(sources[input_dtype]) if raw.dtype != sources[input_dtype] else raw
        out = src.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        return out.numpy().reshape(data.shape)

    interpreter._nanoserve_original_convert = original
    interpreter._convert_float = convert
