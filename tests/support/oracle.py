"""HF transformers on the same checkpoint as the correctness oracle, and the prompts the parity tests feed it."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def prompts_with_shared_prefixes() -> list[list[int]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 500, 40).tolist()
    prompts = [rng.integers(0, 500, n).tolist() for n in (3, 17, 33, 60, 90, 1, 8)]
    prompts += [prefix + rng.integers(0, 500, n).tolist() for n in (1, 5, 20, 37)]
    prompts.append(prefix[:32])  # exactly two full blocks: a fully cached prompt still computes its last token
    return prompts


def hf_greedy(model_dir, prompts, max_new_tokens) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run to max_new_tokens without changing the distribution
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(out[0, len(p) :].tolist())
    return outs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``out`` against ``ref``, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
