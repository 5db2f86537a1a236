"""Logprobs in OpenAI's two shapes: completions (tokens, token_logprobs, top_logprobs, text_offset) and chat
(content: [{token, logprob, bytes, top_logprobs}]). Entries come from the coordinator with the sampled token
first, then the most likely ones. And vLLM's prompt_logprobs: [null, {token id: {logprob, rank, decoded_token}}]."""

from __future__ import annotations

from client.openai_server.engine_client import EngineClient
from protocol.client_messages import TokenLogprobs
from protocol.outputs import Logprob, PromptLogprobs

_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _pairs(entries) -> list[tuple[list[int], list[float]]]:
    """(ids, logprobs) per token from TokenLogprobs records or {id: logprob} dicts."""
    return [(e.token_ids, e.logprobs) if isinstance(e, TokenLogprobs) else (list(e), list(e.values())) for e in entries]


def _clamp(v: float) -> float:
    return v if v > _FLOOR else _FLOOR


async def completion_logprobs(engine: EngineClient, entries, text_offset: int) -> tuple[dict, int]:
    """The completions ``logprobs`` object for some tokens, and the text offset after them."""
    pairs = _pairs(entries)
    texts = await engine.token_texts([t for ids, _ in pairs for t in ids])
    tokens, token_lps, tops, offsets = [], [], [], []
    k = 0
    for ids, lps in pairs:
        names = texts[k : k + len(ids)]
        k += len(ids)
        tokens.append(names[0])
        token_lps.append(_clamp(lps[0]))
        tops.append({name: _clamp(lp) for name, lp in zip(names, lps)})
        offsets.append(text_offset)
        text_offset += len(names[0])
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}, text_offset


def _entry(name: str, lp: float) -> dict:
    return {"token": name, "logprob": _clamp(lp), "bytes": list(name.encode())}


async def chat_logprobs(engine: EngineClient, entries, top_n: int) -> dict:
    """The chat ``logprobs`` object: each token with its ``top_n`` most likely alternatives."""
    pairs = _pairs(entries)
    texts = await engine.token_texts([t for ids, _ in pairs for t in ids])
    content, k = [], 0
    for ids, lps in pairs:
        names = texts[k : k + len(ids)]
        k += len(ids)
        ranked = sorted(zip(names, lps), key=lambda e: -e[1])[:top_n] if top_n else []
        content.append({**_entry(names[0], lps[0]), "top_logprobs": [_entry(n, lp) for n, lp in ranked]})
    return {"content": content}


def prompt_logprobs_json(entries: PromptLogprobs | None) -> list | None:
    """vLLM's ``prompt_logprobs`` of a completions choice (JSON keys are strings; -inf clamped like the rest)."""
    if entries is None:
        return None
    return [None if d is None else {str(t): _prompt_entry(e) for t, e in d.items()} for d in entries]


def _prompt_entry(e: Logprob) -> dict:
    return {"logprob": _clamp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
