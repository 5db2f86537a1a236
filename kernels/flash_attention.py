"""flash-attn as the attention backend, where it is installed and supports the case (CUDA, fp16/bf16, cache
blocks of a multiple of 256 tokens). The KV write stays our Triton kernel; prefill and decode call flash-attn's
paged varlen and kvcache entry points. flash-attn cannot be installed on the machines we test on, so
tests/kernels/test_flash_attention.py (skipped without it) is this path's only check: run it where flash-attn exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata
from kernels.triton_attention import TritonAttentionBackend


def flash_attn_supports(device: torch.device, block_size: int, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or block_size % 256 or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttentionBackend(TritonAttentionBackend):
    name = "flash"

    def __init__(self) -> None:
        super().__init__()
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen, self._kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        cu_seqlens_k = F.pad(meta.prefill_seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,  # bottom-right aligned: the chunk's queries see the whole cached prefix
            block_table=meta.prefill_block_tables,
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, **_) -> torch.Tensor:
        out = self._kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.decode_seq_lens,
            block_table=meta.decode_block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)

    def warmup(self, *args, **kwargs) -> None:
        pass  # flash-attn is compiled ahead of time
