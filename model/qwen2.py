"""Qwen2 and Qwen2.5: biases on the q, k and v projections (always), none elsewhere."""

from __future__ import annotations

from model.config import ModelConfig
from model.decoder import DecoderForCausalLM, DenseLayout


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def layout(cls, cfg: ModelConfig) -> DenseLayout:
        return DenseLayout(qkv_bias=True)
