"""Mistral: the plain decoder without biases. Its sliding window is not implemented: ModelConfig.check_max_model_len
admits a checkpoint with one only while max_model_len stays within the window, where attention is exact."""

from __future__ import annotations

from model.config import ModelConfig
from model.decoder import DecoderForCausalLM, DenseLayout


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def layout(cls, cfg: ModelConfig) -> DenseLayout:
        return DenseLayout()
