"""Tiny random-weight Qwen3-MoE checkpoints written with transformers' own classes (the tests' oracle), beside the
dense ones of model/tiny.py and with its tokenizer: head_dim 32, GQA 6:2, an odd vocabulary, 8 experts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from model.tiny import TinySpec, write_tiny_checkpoint


@dataclass(slots=True)
class TinyMoeSpec:
    vocab_size: int = 509
    hidden_size: int = 64
    intermediate_size: int = 96  # the dense layers'
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=lambda: [1])
    decoder_sparse_step: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    seed: int = 0
    std: float = 0.2  # as model/tiny.py: with HF's 0.02 a random model just repeats its input


# Wider than the CPU tests' checkpoints: 64 experts, top-8, the first layer dense (the bf16 GPU tests' checkpoint)
WIDE_BF16 = TinyMoeSpec(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    mlp_only_layers=[0],
    dtype="bfloat16",
    std=0.05,
    seed=6,
)


def write_tiny_moe_checkpoint(out_dir: str | Path, spec: TinyMoeSpec | None = None) -> Path:
    """model/tiny.py's writer with transformers' Qwen3-MoE classes and the expert fields."""
    spec = spec or TinyMoeSpec()
    moe = {
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "norm_topk_prob": spec.norm_topk_prob,
        "mlp_only_layers": spec.mlp_only_layers,
        "decoder_sparse_step": spec.decoder_sparse_step,
    }
    shared = {f.name: getattr(spec, f.name) for f in fields(TinySpec) if hasattr(spec, f.name)}
    dense = TinySpec(**shared, extra=moe, architecture="Qwen3MoeForCausalLM")
    return write_tiny_checkpoint(out_dir, dense)


def router_margins(hf_model, ids: list[int]) -> torch.Tensor:
    """Per token of ``ids``, the smallest gap over ``hf_model``'s MoE layers between the router logits of the last
    expert it picks and the first it leaves out. A gap of a few bf16 steps is a near-tie: a rounding difference
    upstream may pick the other expert, which moves the logits far more than rounding does."""
    inputs, hooks = [], []
    for layer in hf_model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:  # the router's input: the MoE block's
            hooks.append(layer.mlp.register_forward_pre_hook(lambda m, args: inputs.append((m.gate, args[0]))))
    try:
        with torch.no_grad():
            hf_model(torch.tensor([ids], device=hf_model.device))
    finally:
        for h in hooks:
            h.remove()
    k = hf_model.config.num_experts_per_tok
    gaps = []
    for gate, hidden in inputs:
        logits = hidden.reshape(-1, hidden.shape[-1]).float() @ gate.weight.float().T
        top = logits.topk(k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])
    return torch.stack(gaps).amin(0)
