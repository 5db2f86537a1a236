"""Llama 2/3.x: the plain decoder; attention and MLP biases when the config asks for them."""

from __future__ import annotations

from model.config import ModelConfig
from model.decoder import DecoderForCausalLM, DenseLayout


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def layout(cls, cfg: ModelConfig) -> DenseLayout:
        return DenseLayout(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
