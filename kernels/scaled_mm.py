"""FP8 products through ``torch._scaled_mm`` (cuBLASLt): which scalings this torch build and device run correctly
(checked once per device, outside CUDA graphs, by ``probe_scaled_mm``), which products go there
(``uses_scaled_mm``), and the calls: rowwise scales for per-channel weights, 1x128 activation blocks against
128x128 weight blocks, or no scales (``unscaled_mm``). kernels/fp8_gemm.py's ``fp8_linear`` chooses between these,
the GEMV and our Triton GEMM."""

from __future__ import annotations

import functools

import torch

from kernels.fp8_quant import quantize_rows


def scaled_mm(x_q, x_s, w_q, w_s, block, bias, out) -> torch.Tensor:
    """cuBLASLt through torch: rowwise scales ([M, 1] and [1, N]), or 1x128 activation blocks ([M, K/128], M the
    unit-stride dim) against 128x128 weight blocks (the [N/128, K/128] scales transposed, as torch expects)."""
    scale_b = w_s.view(1, -1) if block is None else w_s.t()
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=scale_b, bias=bias, out_dtype=out.dtype, out=out)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def unscaled_mm(x_q: torch.Tensor, w_q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x_q @ w_q.T`` of e4m3 operands into the 16-bit ``out``, with scalar scales of 1: cuBLASLt then picks from its
    whole FP8 catalogue (kernels/fp8_rescale.py applies the real scales after)."""
    one = _one(out.device)
    return torch._scaled_mm(x_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=out.dtype, out=out)


@functools.cache
def _modes(index: int) -> frozenset[str]:
    """Which scalings torch._scaled_mm runs correctly here: "channel" (rowwise), "block" (1x128 by 128x128), each
    checked against the product of the dequantized operands."""
    device = torch.device("cuda", index)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 512, device=device, generator=gen).bfloat16()
    w_q = torch.randn(256, 512, device=device, generator=gen).mul(40).to(torch.float8_e4m3fn)
    modes = set()
    for mode, block in (("channel", None), ("block", (128, 128))):
        shape = (256,) if block is None else (2, 4)
        w_s = torch.rand(shape, device=device, generator=gen) + 0.5
        x_q, x_s = quantize_rows(x, None if block is None else 128)
        if block is None:
            ref = (x_q.float() * x_s) @ (w_q.float() * w_s[:, None]).t()
        else:
            w_full = w_s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            ref = (x_q.float() * x_s.repeat_interleave(128, 1)) @ (w_q.float() * w_full).t()
        out = torch.empty(64, 256, dtype=torch.bfloat16, device=device)
        try:
            scaled_mm(x_q, x_s, w_q, w_s, block, None, out)
        except (RuntimeError, ValueError, TypeError):  # torch's checks raise all three
            continue
        if ((out.float() - ref).norm() / ref.norm()).item() < 1e-2:
            modes.add(mode)
    return frozenset(modes)


def probe_scaled_mm(device: torch.device) -> frozenset[str]:
    """Run (once per device, outside CUDA graphs) the check of which scalings torch._scaled_mm supports here."""
    return _modes(device.index if device.index is not None else torch.cuda.current_device())


def uses_scaled_mm(n: int, k: int, block: tuple[int, int] | None, device: torch.device) -> bool:
    """Whether a product of more rows than the GEMV takes goes to cuBLASLt (else our Triton kernel)."""
    if n % 16 or k % 16 or device.type != "cuda":
        return False
    if block is None:
        return "channel" in probe_scaled_mm(device)
    # cuBLASLt's block scaling: 128x128 weight blocks (and activation scales with 16-byte aligned strides, which
    # block_scaled_mm pads the rows for)
    return block == (128, 128) and k % 512 == 0 and "block" in probe_scaled_mm(device)


def block_scaled_mm(x, w_q, w_s, block, bias, out) -> torch.Tensor:
    """cuBLASLt's block-scaled product. Its activation scales [M, K/128] (M the unit-stride dim) need a 16-byte
    aligned stride, so M is padded to a multiple of 4 with zero rows, computed into a scratch output."""
    m, n = x.shape[0], w_q.shape[0]
    rows = -(-m // 4) * 4
    x_q, x_s = quantize_rows(x, block[1], rows)
    dst = out if rows == m else torch.empty((rows, n), dtype=out.dtype, device=out.device)
    scaled_mm(x_q, x_s, w_q, w_s, block, None, dst)  # no bias epilogue with block scaling
    if dst is not out:
        out.copy_(dst[:m])
    return out if bias is None else out.add_(bias)
