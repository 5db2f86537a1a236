"""Rotary position embedding (neox style) and the torch path of per-head q/k norm + RoPE."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), cos/sin cached per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope(
    positions: torch.Tensor,
    qk: torch.Tensor,
    num_q_heads: int,
    q_norm: nn.Module,
    k_norm: nn.Module,
    rope: RotaryEmbedding,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE (torch). ``qk``: [tokens, q heads + k heads, head_dim], the q and k
    part of the qkv projection. On CUDA, PagedAttention.forward_qk_norm_rope does this in one fused kernel."""
    return rope(positions, q_norm(qk[:, :num_q_heads]), k_norm(qk[:, num_q_heads:]))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
