"""Rotary position embedding (neox style) with the static frequency scalings of HF checkpoints (linear, llama3,
yarn), and the torch path of the optional per-head q/k norm + RoPE.

The frequency arithmetic follows transformers.modeling_rope_utils operation for operation, in float32, so a
float32 model rotates exactly as HF's does."""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import RopeScaling


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # wavelengths shorter than context/high_freq_factor keep their frequency, longer than context/low_freq_factor
    # are slowed by the factor; the band between blends the two linearly in context/wavelength
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    short_wave = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(long_wave, inv_freq / s.factor, inv_freq)
    blend = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - blend) * scaled / s.factor + blend * scaled
    return torch.where(~short_wave * ~long_wave, blended, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    # dimensions that turn fewer than beta_slow times over the pretraining context are interpolated (divided by
    # the factor), those turning more than beta_fast times kept; a linear ramp over dimensions in between
    def dim_of(rotations: float) -> float:
        ctx = s.original_max_position_embeddings
        return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    powers = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    return (1.0 / (s.factor * powers)) * (1 - keep) + (1.0 / powers) * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the factor cos and sin are multiplied by."""
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling), scaling.attention_factor
    inv_freq = _base_inv_freq(head_dim, theta)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq, scaling.attention_factor


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), cos/sin cached per position (already scaled by the attention factor, so
    the fused kernel and the torch path need no scaling of their own)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling or RopeScaling())
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope(
    positions: torch.Tensor,
    qk: torch.Tensor,
    num_q_heads: int,
    q_norm: nn.Module | None,
    k_norm: nn.Module | None,
    rope: RotaryEmbedding,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (when the family has them), then RoPE (torch). ``qk``: [tokens, q heads + k
    heads, head_dim], the q and k part of the qkv projection. On CUDA, PagedAttention.forward_qk_norm_rope does
    this in one fused kernel."""
    q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return rope(positions, q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
