"""The optional flash-attn backend against the torch reference (runs only where flash-attn and CUDA exist)."""

import pytest
import torch

from kernels.attention import AttentionMetadata, TorchAttentionBackend
from kernels.backends import get_backend

flash_attn = pytest.importorskip("flash_attn")
pytestmark = pytest.mark.gpu


def test_flash_backend_matches_reference():
    device, dtype, page = torch.device("cuda"), torch.bfloat16, 256
    backend = get_backend("flash", device, page, dtype)
    ref = TorchAttentionBackend()
    kc = torch.randn(8, page, 2, 128, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    # two prefills (one continuing a 300-token cached prefix), then two decodes
    q_lens, seq_lens = [50, 20], [50, 320]
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), 8, 128, device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        num_prefill_tokens=q.shape[0],
        num_prefills=2,
        num_decodes=0,
        cu_seqlens_q=torch.tensor([0, 50, 70], dtype=torch.int32, device=device),
        prefill_seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        prefill_block_tables=tables,
        max_seqlen_q=50,
        max_seqlen_k=320,
    )
    got, want = backend.prefill(q, kc, vc, meta, 0.1), ref.prefill(q, kc, vc, meta, 0.1)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
    meta.decode_seq_lens = torch.tensor([300, 7], dtype=torch.int32, device=device)
    meta.decode_block_tables = torch.tensor([[4, 5], [6, 7]], dtype=torch.int32, device=device)
    qd = torch.randn(2, 8, 128, device=device, dtype=dtype)
    got, want = backend.decode(qd, kc, vc, meta, 0.1), ref.decode(qd, kc, vc, meta, 0.1)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
