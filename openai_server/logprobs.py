"""Logprobs in OpenAI's two shapes: completions (tokens, token_logprobs, top_logprobs, text_offset) and chat
(content: [{token, logprob, bytes, top_logprobs}]). Entries come from the coordinator with the sampled token
first, then the most likely ones. And vLLM's prompt_logprobs: [null, {token id: {logprob, rank, decoded_token}}],
which an echoed completion with logprobs also shows in the completions shape, before the generated tokens."""

from __future__ import annotations

from itertools import islice

from openai_server.engine_client import EngineClient
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


def _top(entry: dict[int, Logprob], n: int | None) -> dict[int, Logprob]:
    """A prompt position's entry cut to the prompt token (first) and the top ``n`` by rank: what the engine gives
    for prompt_logprobs=n when it computed more (all of it for None)."""
    if n is None:
        return entry
    return {t: e for i, (t, e) in enumerate(entry.items()) if i == 0 or e.rank <= n}


def prompt_logprobs_json(entries: PromptLogprobs | None, top_n: int | None = None) -> list | None:
    """vLLM's ``prompt_logprobs`` (a completions choice's, a chat response's): each position's prompt token and
    top ``top_n`` (JSON keys are strings; -inf clamped like the rest)."""
    if entries is None:
        return None
    return [None if d is None else {str(t): _prompt_entry(e) for t, e in _top(d, top_n).items()} for d in entries]


def _prompt_entry(e: Logprob) -> dict:
    return {"logprob": _clamp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}


async def echo_logprobs(
    engine: EngineClient,
    prompt_ids: list[int],
    prompt_entries: PromptLogprobs | None,
    entries,
    top_n: int,
    echo_chars: int,
) -> dict:
    """The completions ``logprobs`` of an echoed choice, as vLLM's: the prompt tokens first (the first, which
    nothing predicts, with null ``token_logprobs`` and ``top_logprobs``), each with its ``top_n`` alternatives,
    then the generated tokens. Offsets index the choice's text: the prompt's run from 0, the generated ones from
    ``echo_chars``, where the echoed prompt ends."""
    cut = [None if d is None else _top(d, top_n) for d in prompt_entries or ()]
    cut += [None] * (len(prompt_ids) - len(cut))  # positions never computed (a request aborted in its prefill)
    alternatives = [t for d in cut if d is not None for t in d]
    names = await engine.token_texts([*prompt_ids, *alternatives])
    tokens, names = names[: len(prompt_ids)], iter(names[len(prompt_ids) :])
    offsets, token_lps, tops, at = [], [], [], 0
    for text, d in zip(tokens, cut):
        offsets.append(at)
        at += len(text)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lps = [_clamp(e.logprob) for e in d.values()]
        token_lps.append(lps[0])
        tops.append(dict(zip(islice(names, len(lps)), lps)))
    out = {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}
    generated, _ = await completion_logprobs(engine, entries or [], echo_chars)
    return {key: out[key] + generated[key] for key in out}
