"""A paged KV pool for attention-kernel tests, on the GPU where there is one (else the CPU, where conftest.py has
switched the Triton interpreter on), with the torch reference and the Triton backend to compare."""

from __future__ import annotations

import math

import torch

from kernels.attention import AttentionMetadata, TorchAttentionBackend
from kernels.triton_attention import TritonAttentionBackend

ON_GPU = torch.cuda.is_available()  # without CUDA, conftest.py has switched the Triton interpreter on
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

REF = TorchAttentionBackend()
TRI = TritonAttentionBackend()


def decode_backend(keys_m: bool) -> TritonAttentionBackend:
    """A backend whose decode runs one-warp programs, which take the keys as the dots' M (``keys_m``), or 4-warp ones,
    which pad the query group to 16 rows as M (kernels/attention_decode.py split_decode picks by the warps)."""
    if keys_m:
        return TritonAttentionBackend(decode_tiles=(16, 1, 2) if ON_GPU else (16, 1, 1))
    return TritonAttentionBackend(decode_tiles=(64, 4, 2) if ON_GPU else (16, 4, 1))


class PagedCache:
    """A NaN-poisoned pool with sequences scattered over shuffled blocks; extra NaN blocks serve as table padding."""

    def __init__(
        self,
        lengths: list[int],
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        gen: torch.Generator,
        extra_cols: int = 3,
    ) -> None:
        need = [math.ceil(n / block_size) for n in lengths]
        num_poison = 2
        num_blocks = sum(need) + num_poison + 1  # +1: block 0 stays unused (finite after nan_to_num)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        poison, ids = ids[:num_poison], ids[num_poison:]
        width = max(need, default=0) + extra_cols
        self.table = torch.empty(len(lengths), max(width, 1), dtype=torch.int32)
        self.ref_table = torch.zeros_like(self.table)  # reference reads every column: pad with block 0
        for i, (n, nb) in enumerate(zip(lengths, need)):
            own, ids = ids[:nb], ids[nb:]
            pad = [poison[j % num_poison] for j in range(self.table.shape[1] - nb)]
            self.table[i] = torch.tensor(own + pad, dtype=torch.int32)
            self.ref_table[i, :nb] = torch.tensor(own, dtype=torch.int32)
            if n:
                slots = self.slots(own, n)
                kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
                self.k.view(-1, num_kv_heads, head_dim)[slots] = kv[0]
                self.v.view(-1, num_kv_heads, head_dim)[slots] = kv[1]
        self.table = self.table.to(DEVICE)
        self.ref_table = self.ref_table.to(DEVICE)

    def slots(self, blocks: list[int], n: int) -> torch.Tensor:
        bs = self.k.shape[1]
        pos = torch.arange(n)
        return (torch.tensor(blocks, dtype=torch.long)[pos // bs] * bs + pos % bs).to(DEVICE)

    def clean(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The vectorised torch decode multiplies masked probabilities (0) by every gathered V: NaN would leak.
        return torch.nan_to_num(self.k), torch.nan_to_num(self.v)


def prefill_meta(cache: PagedCache, cu: torch.Tensor, kv_lens: list[int], q_lens: list[int]) -> AttentionMetadata:
    """Prefill-only metadata for chunks of ``q_lens`` new tokens ending at ``kv_lens``, over ``cache``'s tables."""
    num_tokens = int(cu[-1])
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        num_prefill_tokens=num_tokens,
        num_prefills=len(q_lens),
        num_decodes=0,
        cu_seqlens_q=cu.to(DEVICE),
        prefill_seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        prefill_block_tables=cache.table,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens),
    )
