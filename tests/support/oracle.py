"""HF transformers on the same checkpoint as the correctness oracle, and the prompts the parity tests feed it."""

from __future__ import annotations

from pathlib import Path

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


_GREEDY: dict[tuple, list[int]] = {}


def _checkpoint_key(model_dir) -> tuple:
    """The directory and its files' sizes and mtimes: a checkpoint rewritten in place is a new key."""
    path = Path(model_dir).resolve()
    return (str(path), *sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()))


def hf_greedy(model_dir, prompts, max_new_tokens) -> list[list[int]]:
    """HF's greedy tokens for each prompt; each (checkpoint, prompt, length) is generated once per test process
    (several tests and parameters compare with the same continuations)."""
    key = _checkpoint_key(model_dir)
    todo = [p for p in prompts if (key, tuple(p), max_new_tokens) not in _GREEDY]
    if todo:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # run to max_new_tokens without changing the distribution
        hf.generation_config.repetition_penalty = 1.0  # plain greedy, whatever the checkpoint recommends
        with torch.no_grad():
            for p in todo:
                ids = torch.tensor([p])
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
                )
                _GREEDY[key, tuple(p), max_new_tokens] = out[0, len(p) :].tolist()
    return [list(_GREEDY[key, tuple(p), max_new_tokens]) for p in prompts]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``out`` against ``ref``, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_greedy_equal_up_to_ties(model_dir, prompts, got, expected, margin: float = 1e-2) -> None:
    """Greedy tokens equal HF's, except that a sequence may leave HF's path where HF's logits of the two tokens lie
    within ``margin`` of each other (a near-tie that another summation order, a GPU's, may break the other way);
    past that step its tokens are free. Where they differ anywhere else, the engine is wrong."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for n, (p, g, e) in enumerate(zip(prompts, got, expected, strict=True)):
        if g == e:
            continue
        i = next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([p + e[:i]])).logits[0, -1]
        gap = (logits[e[i]] - logits[g[i]]).item()
        assert gap < margin, f"prompt {n}: token {i} is {g[i]}, HF's is {e[i]} with a logit {gap:.4f} higher"
