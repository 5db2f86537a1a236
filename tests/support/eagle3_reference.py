"""An independent EAGLE-3 reference for one sequence, to check the engine's drafts against: the target is HF
transformers (its ``hidden_states[i]`` is the stream entering layer i, the embedding for i = 0), the draft layer is
written here in plain torch with dense causal attention over the whole context (no paging, no KV pool), straight from
the safetensors file.

``run_accepting_all`` replays what the engine does under NANOSERVE_BENCH_ACCEPT_DRAFTS=1 (every draft kept) with
synchronous scheduling: the prefill's token, then per step k drafts (capped by max_tokens) and the target's bonus
token after them. The draft's K/V at position p comes from the target's states at p and the token at p + 1; the
first draft is the draft's output at the last computed position, each next one a draft forward one position later
on the draft before it and the draft's own hidden state (pre-norm)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, dim] at positions ``pos``."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = (pos.double()[:, None] * inv[None]).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = dim // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class ReferenceDraft:
    def __init__(self, draft_dir: Path, target_embedding: torch.Tensor, aux_ids: list[int]) -> None:
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.w = {
            k.replace("midlayer.", ""): v.float() for k, v in load_file(str(draft_dir / "model.safetensors")).items()
        }
        self.embed = self.w.get("embed_tokens.weight", target_embedding)
        self.aux_ids = aux_ids
        self.keys = self.values = None

    def layer(self, ids: torch.Tensor, pos: torch.Tensor, feature: torch.Tensor):
        """(normed, prenorm) of tokens at ``pos`` (appended to the draft's context: K/V kept)."""
        w, c = self.w, self.cfg
        eps, heads, kv, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = torch.cat(
            [_rms(self.embed[ids], w["input_layernorm.weight"], eps), _rms(feature, w["hidden_norm.weight"], eps)], -1
        )
        residual = feature
        q = _rope((x @ w["self_attn.q_proj.weight"].T).view(-1, heads, hd), pos, c["rope_theta"])
        k = _rope((x @ w["self_attn.k_proj.weight"].T).view(-1, kv, hd), pos, c["rope_theta"])
        v = (x @ w["self_attn.v_proj.weight"].T).view(-1, kv, hd)
        self.keys = k if self.keys is None else torch.cat([self.keys, k])
        self.values = v if self.values is None else torch.cat([self.values, v])
        ctx = len(self.keys)
        rep = heads // kv
        keys, values = self.keys.repeat_interleave(rep, 1), self.values.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / hd**0.5
        mask = torch.arange(ctx)[None] > (ctx - len(ids) + torch.arange(len(ids)))[:, None]
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), values)
        h = attn.flatten(1) @ w["self_attn.o_proj.weight"].T + residual
        m = _rms(h, w["post_attention_layernorm.weight"], eps)
        m = (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        pre = m + h
        return _rms(pre, w["norm.weight"], eps), pre

    def greedy(self, normed: torch.Tensor) -> int:
        best = int((normed @ self.w["lm_head.weight"].T).argmax())
        return best + int(self.w["d2t"][best])


@torch.no_grad()
def run_accepting_all(
    target_dir: Path, draft_dir: Path, prompt: list[int], max_tokens: int, k: int, aux_ids
) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = ReferenceDraft(Path(draft_dir), hf.model.embed_tokens.weight.float(), list(aux_ids))

    def target_next(tokens: list[int]) -> int:
        return int(hf(torch.tensor([tokens])).logits[0, -1].argmax())

    tokens = [*prompt, target_next(prompt)]
    while len(tokens) - len(prompt) < max_tokens:
        cap = min(k, max_tokens - (len(tokens) - len(prompt)) - 1)
        if cap <= 0:
            tokens.append(target_next(tokens))
            continue
        n = len(tokens)
        states = hf(torch.tensor([tokens[: n - 1]]), output_hidden_states=True).hidden_states
        feature = torch.cat([states[i][0] for i in draft.aux_ids], -1) @ draft.w["fc.weight"].T
        draft.keys = draft.values = None
        normed, pre = draft.layer(torch.tensor(tokens[1:n]), torch.arange(n - 1), feature)
        drafts, hidden = [draft.greedy(normed[-1])], pre[-1:]
        for j in range(1, cap):
            normed, hidden = draft.layer(torch.tensor(drafts[-1:]), torch.tensor([n - 2 + j]), hidden)
            drafts.append(draft.greedy(normed[-1]))
        tokens += drafts
        tokens.append(target_next(tokens))
    return tokens[len(prompt) : len(prompt) + max_tokens]
