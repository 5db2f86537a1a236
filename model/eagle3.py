"""The EAGLE-3 draft model: one decoder layer over [token embedding, fused feature], its own LM head over a draft
vocabulary, and the map of draft ids to target ids. Replicated on every tensor-parallel rank (plain linear layers, no
collectives); its attention is a PagedAttention whose K/V lives in the draft's own pool (worker/eagle_drafter.py).

forward(ids, positions, feature) -> (normed, prenorm): ``feature`` is either the three target hidden states fused by
``fuse`` (3 x target hidden -> hidden) or, for a later draft step, the ``prenorm`` output of the step before; the
token at a position is the one that FOLLOWS the feature's position (the draft predicts the token after it)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.eagle3_config import LAYER, Eagle3CheckpointError, Eagle3Config, load_tensor, tensor_files
from model.layers import PagedAttention, RMSNorm, SiluAndMul
from model.rotary import RotaryEmbedding


def _linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    layer.requires_grad_(False)
    return layer


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, max_position: int) -> None:
        super().__init__()
        self.cfg = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.fc = _linear(3 * cfg.target_hidden_size, h)
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)
        self.q_proj = _linear(2 * h, q, cfg.attention_bias)
        self.k_proj = _linear(2 * h, kv, cfg.attention_bias)
        self.v_proj = _linear(2 * h, kv, cfg.attention_bias)
        self.o_proj = _linear(q, h)
        self.gate_proj = _linear(h, cfg.intermediate_size)
        self.up_proj = _linear(h, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, h)
        self.act = SiluAndMul()
        self.lm_head = _linear(h, cfg.draft_vocab_size)
        # set by ``load_eagle3``: the checkpoint's own embedding, or the target's shared
        self.embed_weight: torch.Tensor = torch.empty(0)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """[tokens, 3 x target hidden] (the target's three captured residual streams) -> the draft's feature."""
        return self.fc(target_states)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor):
        embeds = self.input_layernorm(F.embedding(ids, self.embed_weight))
        if self.cfg.norm_before_residual:
            x = residual = self.hidden_norm(feature)
        else:
            x, residual = self.hidden_norm(feature), feature
        x = torch.cat([embeds, x], dim=-1)
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        x = self.o_proj(self.attn(q, k, v).flatten(1))
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.down_proj(self.act(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))
        return self.norm(x, residual)

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """The most likely next token of each row, as a target id (draft id + d2t offset)."""
        best = self.lm_head(normed).argmax(-1)
        return best + self.d2t[best]


def load_eagle3(
    cfg: Eagle3Config,
    target_embedding: torch.Tensor | None,
    target_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int,
) -> Eagle3Draft:
    """The draft with the checkpoint's weights. Without its own embedding it shares the target's:
    ``target_embedding`` when that is the whole table (one rank), else the target checkpoint's tensor, read whole
    (each rank holds a full copy: the draft runs without collectives)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Eagle3Draft(cfg, max_position)
    finally:
        torch.set_default_dtype(prev)
    where = tensor_files(Path(cfg.directory))
    params = dict(model.named_parameters())
    for name in cfg.expected_tensors():
        tensor = load_tensor(where, name)
        if name == "d2t":
            model.d2t.copy_(tensor.long())
        elif name == "embed_tokens.weight":
            model.embed_weight = tensor.to(device, dtype)
        else:
            ours = name.removeprefix(LAYER).replace("self_attn.", "").replace("mlp.", "")
            params[ours].data.copy_(tensor)
    if not cfg.has_embedding:
        if target_embedding is not None and target_embedding.shape[0] >= cfg.vocab_size:
            model.embed_weight = target_embedding[: cfg.vocab_size]
        else:
            model.embed_weight = _target_embedding(Path(target_dir)).to(device, dtype)
    return model.eval()


def _target_embedding(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    from model.loader import checkpoint_files

    for f in checkpoint_files(target_dir):
        with safe_open(str(f), framework="pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                return st.get_tensor("model.embed_tokens.weight")
    raise Eagle3CheckpointError(
        f"the draft has no embed_tokens.weight and the target checkpoint {target_dir} has no model.embed_tokens.weight"
    )
