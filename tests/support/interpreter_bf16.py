"""Triton's CPU interpreter (TRITON_INTERPRET=1, Triton 3.4-3.9) keeps bf16 as raw uint16 and gets two things wrong
that the GPU does right: float32 -> bf16 conversions truncate (the GPU's ``cvt.rn.bf16.f32`` rounds to nearest
even), and ``tl.dot`` on bf16 operands multiplies the raw integers. ``bf16_like_the_gpu`` converts as torch does
(round to nearest even) and multiplies bf16 operands as their float32 values (exact products, accumulated in
float32 as the GPU's MMAs do), then restores the interpreter; the kernels stay exactly the GPU code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def bf16_like_the_gpu() -> Iterator[None]:
    from triton._C.libtriton import ir
    from triton.language import core as tl
    from triton.runtime import interpreter

    convert, builder = interpreter._convert_float, interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def to_bf16(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16 or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return interpreter_convert(data, input_dtype, output_dtype, rounding_mode)
        src = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).copy())
        return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 and b.dtype.scalar == tl.bfloat16:
            a_f32 = convert(a.data, tl.bfloat16, tl.float32, None).view(np.float32)
            b_f32 = convert(b.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(np.matmul(a_f32, b_f32, dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter_convert = convert
    interpreter._convert_float, builder.create_dot = to_bf16, dot
    try:
        yield
    finally:
        interpreter._convert_float, builder.create_dot = convert, create_dot
