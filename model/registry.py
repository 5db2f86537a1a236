"""Which module builds each Hugging Face architecture (config.json's ``architectures``): adding a family is one file in
model/ plus one line here. Modules are imported on first use, so reading a config never loads a model file."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # reading a config (the coordinator) must not load torch
    from torch import nn

# architecture name -> "module:class"
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "model.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "model.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "model.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "model.qwen3_moe:Qwen3MoeForCausalLM",
}


def model_class(architecture: str) -> type[nn.Module]:
    module, _, name = ARCHITECTURES[architecture].partition(":")
    return getattr(importlib.import_module(module), name)
