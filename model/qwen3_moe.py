"""Qwen3-MoE: dense Qwen3's attention and decoder layers; the MLP of a layer is a mixture of experts wherever HF's
rule puts one (``ModelConfig.is_moe_layer``: not in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer),
a dense MLP of ``intermediate_size`` elsewhere."""

from __future__ import annotations

from torch import nn

from model.config import ModelConfig
from model.decoder import GatedMLP
from model.moe import EXPERT_PROJECTIONS, SparseMoeBlock
from model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # checkpoint projection of one expert -> our stacked parameter (model/loader.py)
    expert_params_mapping = {proj: param for proj, (param, _) in EXPERT_PROJECTIONS.items()}

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if not cfg.is_moe_layer(layer):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return SparseMoeBlock(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, cfg.norm_topk_prob
        )
