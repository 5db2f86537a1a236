"""Choosing an attention backend by name. The backends import kernels/attention.py (the interface) and this module
imports them, only the one chosen and only when asked: imports run one way, with no circle."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, TorchAttentionBackend
from settings.defaults import ATTENTION_BACKENDS as BACKEND_NAMES


def get_backend(
    name: str, device: torch.device, block_size: int = 16, dtype: torch.dtype = torch.bfloat16
) -> AttentionBackend:
    """``auto``: flash-attn on CUDA where it is installed and supports the case (``dtype``: the KV cache's; flash-attn
    reads 16-bit caches only), else our Triton kernels; the torch reference on the CPU."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto" and device.type != "cuda":
        name = "torch"
    elif name == "auto":
        from kernels.flash_attention import flash_attn_supports

        name = "flash" if flash_attn_supports(device, block_size, dtype) else "triton"
    if name == "flash":
        from kernels.flash_attention import FlashAttentionBackend, flash_attn_supports

        if not flash_attn_supports(device, block_size, dtype):
            raise ValueError(
                "attention_backend 'flash' needs flash-attn installed, CUDA, an fp16/bf16 KV cache and "
                "block_size % 256 == 0"
            )
        return FlashAttentionBackend()
    if name == "triton":
        from kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()
