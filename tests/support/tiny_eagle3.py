"""Tiny EAGLE-3 draft checkpoints in the public layout (the key names and config fields of the drafts published for
Llama-3.1-8B-Instruct and Qwen3-8B: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), written for a
tiny target checkpoint: random weights, or a "copy" draft built from the target's own embedding that predicts the
token at the feature's position again (a tied target with small weights repeats its last token, so the copy draft's
guesses get accepted)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.eagle3_config import layer_shapes, layout_config
from model.loader import checkpoint_files


@dataclass(slots=True)
class DraftSpec:
    draft_vocab_size: int | None = None  # None: the target's vocabulary; else a random subset mapped by d2t
    intermediate_size: int = 96
    aux_layer_ids: list[int] | None = None  # None: the field is left out (the default (2, L // 2, L - 3) applies)
    copy: bool = False  # attention and MLP off, fc picks the first feature (aux ids [0, ..]: the embedding)
    embed: bool = False  # the checkpoint carries its own embed_tokens.weight
    layer_prefix: str = "midlayer."
    std: float = 0.05
    seed: int = 5
    config: dict = field(default_factory=dict)  # config.json overrides (None deletes the key)
    drop: tuple[str, ...] = ()  # tensors left out
    reshape: dict = field(default_factory=dict)  # tensor name -> a shape it is written with instead


def write_tiny_eagle3(out_dir: str | Path, target_dir: str | Path, spec: DraftSpec | None = None) -> Path:
    spec = spec or DraftSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(spec.seed)
    draft_vocab = spec.draft_vocab_size or vocab
    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    if spec.copy and draft_vocab == vocab:  # a permuted map: the copy draft then goes through d2t for real
        chosen = torch.randperm(vocab, generator=gen)
    d2t = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * spec.std

    p, inter = spec.layer_prefix, spec.intermediate_size
    shapes = layer_shapes(h, heads * head_dim, kv_heads * head_dim, inter, draft_vocab, h, layer=p)
    tensors = {  # norms around 1, the rest small; drawn in the layout's order
        name: torch.rand(shape, generator=gen) + 0.5 if name.endswith("norm.weight") else rand(*shape)
        for name, shape in shapes.items()
    }
    tensors.update(d2t=d2t, t2d=t2d)
    embedding = _target_embedding(Path(target_dir)).float()
    if spec.embed:
        tensors["embed_tokens.weight"] = embedding.clone()
    if spec.copy:  # prenorm = the feature = the embedding of the token at the feature's position
        tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], dim=1)
        tensors[f"{p}self_attn.o_proj.weight"].zero_()
        tensors[f"{p}mlp.down_proj.weight"].zero_()
        tensors["norm.weight"] = torch.ones(h)
        tensors["lm_head.weight"] = embedding[chosen].clone()
    for name in spec.drop:
        tensors.pop(name)
    for name, shape in spec.reshape.items():
        tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = layout_config(
        h,
        inter,
        heads,
        kv_heads,
        head_dim,
        vocab,
        draft_vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if spec.aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = spec.aux_layer_ids
    for key, value in spec.config.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _target_embedding(target_dir: Path) -> torch.Tensor:
    for f in checkpoint_files(target_dir):
        tensors = load_file(str(f))
        if "model.embed_tokens.weight" in tensors:
            return tensors["model.embed_tokens.weight"]
    raise KeyError("model.embed_tokens.weight")
