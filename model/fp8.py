"""FP8 (e4m3) formats and their arithmetic: which quantization a checkpoint or the engine asks for, weight
quantization (per output channel, or per 128x128 block as DeepSeek-V3 and the Qwen3-FP8 checkpoints store it),
dynamic activation quantization (per token, or per token and 128-column group) and the float32 emulation of an FP8
linear layer that the CPU runs. The GPU kernels (kernels/fp8_gemm.py) compute the same quantities.

Scales are dequantization multipliers throughout: ``real ~= fp8 value * scale`` (the checkpoints' ``weight_scale_inv``
is such a multiplier too, despite its name). A scale is the amax of its group divided by 448, the largest e4m3
value, so the group's largest element maps onto 448.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-10  # an all-zero group gets a tiny scale instead of a division by zero


@dataclass(slots=True, frozen=True)
class Fp8Config:
    """How the linear layers are quantized. ``block`` = (rows, columns) of a weight scale's tile, activations then
    quantized per token and ``block[1]``-column group (a block-FP8 checkpoint); ``block`` None: one weight scale per
    output channel and one activation scale per token (online quantization of a 16-bit checkpoint). ``ignored``:
    checkpoint module names (or name fragments) kept in 16 bits (HF's ``modules_to_not_convert``)."""

    block: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()

    @property
    def act_group(self) -> int | None:
        """Columns per activation scale; None = the whole row (per token)."""
        return None if self.block is None else self.block[1]


def parse_quantization_config(raw: dict | None, source: str) -> Fp8Config | None:
    """A config.json's ``quantization_config``; anything but block-FP8 with dynamic activations is refused."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{source}: quantization_config quant_method {method!r} is not supported (only 'fp8')")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: quantization_config fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"{source}: quantization_config activation_scheme {scheme!r} is not supported (only 'dynamic': "
            "activation scales computed per token group at run time)"
        )
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError(
            f"{source}: fp8 quantization_config without weight_block_size (per-tensor weight scales) is not "
            "supported; nanoserve reads block-quantized FP8 checkpoints, or quantizes 16-bit ones (quantization='fp8')"
        )
    if len(block) != 2 or not all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block):
        raise ValueError(f"{source}: quantization_config weight_block_size {block!r} must be two powers of 2 >= 16")
    ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
    return Fp8Config(block=(block[0], block[1]), ignored=tuple(ignored))


def resolve_quantization(checkpoint: Fp8Config | None, requested: str) -> Fp8Config | None:
    """The engine's ``quantization`` argument against the checkpoint's own: an FP8 checkpoint is served as stored
    ("" or "fp8"); "fp8" on a 16-bit checkpoint quantizes it at load, one scale per output channel."""
    if requested not in ("", "fp8"):
        raise ValueError(f"quantization: unsupported value {requested!r}; choose 'fp8' or leave it empty")
    if checkpoint is not None:
        return checkpoint
    return Fp8Config() if requested == "fp8" else None


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``kv_cache_dtype``: "auto" = the model's dtype; "fp8" (or "fp8_e4m3") = e4m3 with unit scales."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8
    raise ValueError(f"kv_cache_dtype: unsupported value {name!r}; choose auto or fp8")


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 / scale)`` rounded to e4m3 (float32 math; clamped: e4m3fn has no infinity). A product with the
    reciprocal, not a quotient: the GPU kernels then pay one division per scale rather than one per element."""
    inv = torch.ones_like(scale) / scale  # a tensor division, correctly rounded on every device
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # a tensor divisor: CUDA torch turns division by a Python number into a product with its rounded reciprocal,
    # one ulp off the correctly rounded quotient the kernels compute (tl.math.div_rn)
    amax = amax.float().clamp(min=MIN_AMAX)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scales [N] float32): one scale per output channel (row)."""
    scale = _scale_of(w.abs().amax(dim=1))
    return _to_fp8(w, scale[:, None]), scale


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one per element of an [N, K] weight."""
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scales [ceil(N/bn), ceil(K/bk)] float32): one scale per bn x bk tile (the last
    row and column of tiles may be partial), as HF's and vLLM's block-FP8 checkpoints store them."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float().abs()
    scale = _scale_of(padded.view(rows, bn, cols, bk).amax(dim=(1, 3)))
    return _to_fp8(w, expand_blocks(scale, (n, k), block)), scale


def dequantize(w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 weight an FP8 one stands for (per-channel scales [N] or block scales)."""
    if block is None:
        return w_q.float() * scale.float()[:, None]
    return w_q.float() * expand_blocks(scale.float(), tuple(w_q.shape), block)


def quantize_activations(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], scales [M, ceil(K/group)] float32); ``group`` None: one scale per row (token)."""
    m, k = x.shape
    if group is None:
        scale = _scale_of(x.abs().amax(dim=1, keepdim=True))
        return _to_fp8(x, scale), scale
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float().abs()
    scale = _scale_of(padded.view(m, groups, group).amax(dim=2))
    return _to_fp8(x, scale.repeat_interleave(group, 1)[:, :k]), scale


def dequantize_activations(x_q: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    if group is None:
        return x_q.float() * scale
    return x_q.float() * scale.repeat_interleave(group, 1)[:, : x_q.shape[1]]


def emulated_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    cfg: Fp8Config,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """What an FP8 GEMM computes, in float32: activations quantized to e4m3 with the dynamic scales the GPU
    computes, both operands dequantized, one float32 product (only the GEMM's own rounding differs on a GPU)."""
    x_q, x_s = quantize_activations(x, cfg.act_group)
    out = dequantize_activations(x_q, x_s, cfg.act_group) @ dequantize(w_q, w_scale, cfg.block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
