"""Qwen3 (dense): per-head RMSNorm of q and k before RoPE; attention biases when the config asks for them."""

from __future__ import annotations

from model.config import ModelConfig
from model.decoder import DecoderForCausalLM, DenseLayout


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def layout(cls, cfg: ModelConfig) -> DenseLayout:
        return DenseLayout(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
