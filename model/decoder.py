"""The dense decoder-only transformer that Llama, Qwen2, Qwen3 and Mistral share: forward(input_ids, positions) ->
hidden_states; compute_logits on the rows to sample. A family is a subclass naming where its checkpoints differ
(``DenseLayout``: biases, per-head q/k norms) and, for mixtures of experts, which MLP each layer has."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model import fp8_folded
from model.config import ModelConfig
from model.layers import PagedAttention, ParallelLMHead, RMSNorm, SiluAndMul, VocabParallelEmbedding
from model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model.rotary import RotaryEmbedding


@dataclass(slots=True, frozen=True)
class DenseLayout:
    """What a family's checkpoint holds beyond the common tensors."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: DenseLayout, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, layout.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # o_proj and down_proj return partial sums: the norm after each reduces them (one fused kernel on GPUs)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=layout.o_bias, reduce_results=False
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if layout.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if layout.qk_norm else None
        self.rotary_emb = rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv``: the output of ``qkv_proj``, which the layer calls (so that it may take the norm in front)."""
        return self.o_proj(self.attend(positions, qkv))

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The attention output [tokens, heads * head_dim] before ``o_proj``; ``scales``: ``qkv`` is an FP8 product
        before its per-token and per-channel scales (model/fp8_folded.py)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn.forward_qk_norm_rope(positions, qk, v, self.q_norm, self.k_norm, self.rotary_emb, scales)
        return out.flatten(1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); returns this rank's partial sum under tensor parallelism."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, reduce_results=False)
        self.act = SiluAndMul()

    def norm_and_forward(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None):
        """(``self`` of ``norm(hidden + residual)``, the sum) with the norm inside gate/up's GEMV (16 bits) or
        quantizing the rows for gate/up (FP8), or None where that does not apply (the layer then norms first)."""
        gate_up, quant = self.gate_up_proj, self.gate_up_proj.quant
        if quant is not None and gate_up.takes_norm(hidden, residual):  # an FP8 MLP of 2+ rows: its fused path
            if (out := quant.norm_gated_mlp(gate_up, self.down_proj, norm, hidden, residual)) is not None:
                return out
        fused = gate_up.norm_and_forward(norm, hidden, residual)
        if fused is None:
            return None
        gate_up, residual = fused
        return self.down_of(gate_up), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quant = self.gate_up_proj.quant  # an FP8 MLP may run its middle as one kernel
        if quant is not None and (out := quant.gated_mlp(self.gate_up_proj, self.down_proj, x)) is not None:
            return out
        return self.down_of(self.gate_up_proj(x))

    def down_of(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up); an FP8 down GEMV may have the SiLU kernel quantize its row."""
        quant = self.down_proj.quant
        if quant is not None and (out := quant.apply_silu_mul(self.down_proj, gate_up)) is not None:
            return out
        return self.down_proj(self.act(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: DenseLayout, rope: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layout, rope)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_front = getattr(mlp, "norm_and_forward", None)  # an MLP that may take its norm into its own kernels
        # EAGLE-3 (worker/eagle_drafter.py): static buffers [rows, hidden] that receive the residual stream entering
        # this layer; static so that a captured CUDA graph writes the same memory on every replay
        self.aux_outs: tuple[torch.Tensor, ...] = ()

    def capture(self, residual: torch.Tensor) -> None:
        """Copy the stream entering this layer (the embedding for layer 0) into its auxiliary buffers, if any."""
        for out in self.aux_outs:
            out[: residual.shape[0]].copy_(residual)

    def forward(self, positions, hidden, residual):
        """``hidden``: the embedding (first layer, no residual yet) or the previous layer's MLP output as this
        rank's partial sum; returns this layer's MLP output, also unreduced, and the residual stream."""
        fused = self.self_attn.qkv_proj.norm_and_forward(self.input_layernorm, hidden, residual)
        if fused is None:
            if residual is None:
                hidden, residual = self.input_layernorm(hidden), hidden
            else:
                hidden, residual = self.input_layernorm.forward_partial(hidden, residual)
            fused = self.self_attn.qkv_proj(hidden), residual
        qkv, residual = fused
        self.capture(residual)
        hidden = self.self_attn(positions, qkv)
        if self.mlp_front is not None and (out := self.mlp_front(self.post_attention_layernorm, hidden, residual)):
            return out
        hidden, residual = self.post_attention_layernorm.forward_partial(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: DenseLayout, mlps: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, rope, mlp) for mlp in mlps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if fp8_folded.applies(self, hidden):  # FP8 decode batches: each product's scales applied by its reader
            for layer in self.layers:
                hidden, residual = fp8_folded.layer_forward(layer, positions, hidden, residual)
            hidden = hidden.finished()
        else:
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        return self.norm.forward_partial(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """Base of every family: subclasses override ``layout`` (and ``make_mlp`` for a per-layer MLP choice)."""

    # checkpoint name fragment -> (our parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def layout(cls, cfg: ModelConfig) -> DenseLayout:
        raise NotImplementedError

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, self.layout(cfg).mlp_bias)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        mlps = [self.make_mlp(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.model = DecoderModel(cfg, self.layout(cfg), mlps)
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
