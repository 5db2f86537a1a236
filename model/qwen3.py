"""Dense Qwen3: forward(input_ids, positions) -> hidden_states; compute_logits on the rows to sample."""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.layers import PagedAttention, ParallelLMHead, RMSNorm, SiluAndMul, VocabParallelEmbedding
from model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model.rotary import RotaryEmbedding


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # o_proj and down_proj return partial sums: the norm after each reduces them (one fused kernel on GPUs)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False, reduce_results=False
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn.forward_qk_norm_rope(positions, qk, v, self.q_norm, self.k_norm, self.rotary_emb)
        return self.o_proj(out.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, reduce_results=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rope)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        """``hidden``: the embedding (first layer, no residual yet) or the previous layer's MLP output as this
        rank's partial sum; returns this layer's MLP output, also unreduced, and the residual stream."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward_partial(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm.forward_partial(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, mlps: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rope, mlp) for mlp in mlps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm.forward_partial(hidden, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """The MLP of decoder layer ``layer`` (a family with experts overrides this)."""
        return Qwen3MLP(cfg)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, [self.make_mlp(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits for the given rows only; None on ranks other than 0 under tensor parallelism."""
        return self.lm_head(hidden)

    def compute_shard_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's vocabulary shard of the logits for the given rows, and the shard's first token id."""
        return self.lm_head.shard(hidden)
