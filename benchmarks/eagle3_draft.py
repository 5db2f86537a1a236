"""Write a random-weight EAGLE-3 draft in the public layout for a real target shape (benchmarks/shapes.py), as the
drafts published for Llama-3.1-8B-Instruct and Qwen3-8B are laid out: one layer of the target's attention shape,
``fc`` over 3 x hidden, a 32,000-token draft vocabulary with ``d2t``, no embedding (the target's is shared).

    python -m benchmarks.eagle3_draft qwen3-8b     # prints the draft's directory

Random weights accept next to nothing: this measures what drafting costs (acceptance 0, or every draft kept with
NANOSERVE_BENCH_ACCEPT_DRAFTS=1), never what it gains. Cached under ``$NANOSERVE_CACHE/eagle3/NAME``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.shapes import SHAPES
from model.eagle3_config import layer_shapes, layout_config
from settings.env import settings

DRAFT_VOCAB = 32000


def write_draft(name: str) -> Path:
    target = SHAPES[name]
    out = settings().cache_dir / "eagle3" / name
    done = out / "complete"
    if done.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, vocab, inter = target["hidden_size"], target["vocab_size"], target["intermediate_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    hd = target.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    draft_vocab = min(DRAFT_VOCAB, vocab)
    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    shapes = layer_shapes(h, heads * hd, kv * hd, inter, draft_vocab, h)
    tensors = {  # norms of ones, the rest small, in the layout's order
        name: torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else rand(*shape)
        for name, shape in shapes.items()
    }
    tensors["d2t"] = chosen - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True)
    save_file(tensors, str(out / "model.safetensors"))
    rope = {k: target[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in target}
    config = layout_config(
        h,
        inter,
        heads,
        kv,
        hd,
        vocab,
        draft_vocab,
        rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        max_position_embeddings=target.get("max_position_embeddings", 8192),
        torch_dtype="bfloat16",
        **rope,
    )
    layers = target["num_hidden_layers"]
    if layers < 4:  # vLLM's default layers (2, L // 2, L - 3) need 4
        config["eagle_aux_hidden_state_layer_ids"] = [0, layers // 2, layers - 1]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    done.write_text("ok\n")
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("shape", nargs="?", default="qwen3-8b", choices=list(SHAPES), help="the target's shape")
    print(write_draft(p.parse_args().shape))
