"""n-gram speculative decoding end to end through real worker processes: greedy output with speculation is token
for token the output without it, for every model family (tiny random checkpoints: greedy random models fall into
loops, so drafts do get accepted, and every test asserts that some were), at tensor-parallel size 2 (gloo), in a
tight engine (preemption, prefix-cache hits, chunked prefill); stops, max_tokens, n > 1, logprobs and structured
outputs against an engine without speculation; the config refused by key (EAGLE-3: test_speculative_eagle3.py).

The reference inside one engine: ``min_tokens == max_tokens`` with ``ignore_eos`` changes no greedy token (no stop
id is given, and EOS is not masked under ignore_eos) but gets no drafts (proposals start once min_tokens are out)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import coordinator.engine
from coordinator.config import EngineArgError
from model.tiny import write_tiny_checkpoint
from nanoserve import LLM, SamplingParams
from tests.model.test_families import FAMILIES
from tests.support.oracle import prompts_with_shared_prefixes
from tests.support.tiny_moe import TinyMoeSpec, write_tiny_moe_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 40
# small weights: each family's greedy output is close to a fixed map from token to token, which falls into a cycle
# within a few dozen tokens (drafts accepted) after a stretch of no repeats (drafts rejected)
LOOPY_STD = 0.05


def _prompts(vocab: int = 500) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, n).tolist() for n in (4, 19, 40)]


def assert_same_completion(want, got, params: SamplingParams) -> None:
    """One completion with drafts as without: tokens, text, finish and stop reason, and logprobs (1e-4)."""
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, want.finish_reason, want.stop_reason,
    ), params  # fmt: skip
    if params.logprobs:
        assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs]
        for dg, dw in zip(got.logprobs, want.logprobs):
            assert all(dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4) for t in dw)


def _spec_vs_plain(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, accepted: bool = True) -> dict:
    """Greedy tokens with and without drafts in one engine; returns the engine's stats after. ``accepted``: some
    drafts must have been accepted (else only drafted: random EAGLE-3 drafts accept next to nothing)."""
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    assert llm.stats()["spec_decode_num_drafts"] == 0
    spec = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, spec, use_tqdm=False)]
    assert got == want
    stats = llm.stats()
    key = "spec_decode_num_accepted_tokens" if accepted else "spec_decode_num_draft_tokens"
    assert stats[key] > 0, stats  # not vacuous: drafts were accepted (or at least drafted)
    assert stats["spec_decode_num_drafts"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return stats


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_moe"])
def test_greedy_unchanged_every_family(name, tmp_path):
    if name == "qwen3_moe":
        model_dir = write_tiny_moe_checkpoint(tmp_path, TinyMoeSpec(std=LOOPY_STD))
    else:
        model_dir = write_tiny_checkpoint(tmp_path, dataclasses.replace(FAMILIES[name], std=LOOPY_STD))
    with LLM(str(model_dir), max_model_len=128, num_kv_blocks=64, block_size=8, speculative_config=SPEC) as llm:
        stats = _spec_vs_plain(llm, _prompts(500))
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)


def test_greedy_unchanged_tp2(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, dataclasses.replace(FAMILIES["qwen3"], std=LOOPY_STD))
    tp2 = dict(tensor_parallel_size=2, device="cpu", max_model_len=128, num_kv_blocks=64, block_size=8)
    with LLM(str(model_dir), **tp2, speculative_config=SPEC) as llm:
        _spec_vs_plain(llm, _prompts(500))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_unchanged_tight_engine(tiny_tied, async_scheduling):
    # 18 blocks of 8 tokens for 12 requests of up to 130 tokens; 32-token step budget; shared prefixes
    tight = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)
    tight["async_scheduling"] = async_scheduling
    spec = {**SPEC, "disable_by_batch_size": 16}  # speculate in the crowded batch too
    with LLM(str(tiny_tied), **tight, speculative_config=spec) as llm:
        stats = _spec_vs_plain(llm, prompts_with_shared_prefixes(), 40)
    assert stats["preemptions"] > 0 and stats["chunked_prefill_steps"] > 0 and stats["prefix_cache_hit_tokens"] > 0


class _Rows:
    """Every sampled row's emitted tokens per request, and whether it was a verify row (the engine's own result
    application, wrapped)."""

    def __init__(self, monkeypatch) -> None:
        self.rows: dict[str, list[tuple[bool, list[int]]]] = {}
        apply = coordinator.engine.Engine.apply_result

        def wrapped(engine, batch, result):
            tokens, pos = result.token_ids.tolist(), 0
            accepted = [0] * len(batch.sampled) if result.num_accepted is None else result.num_accepted.tolist()
            drafts = batch.drafts or [0] * len(batch.sampled)
            for seq, d, a in zip(batch.sampled, drafts, accepted):
                self.rows.setdefault(seq.request_id, []).append((d > 0, tokens[pos : pos + 1 + a]))
                pos += 1 + a
            return apply(engine, batch, result)

        monkeypatch.setattr(coordinator.engine.Engine, "apply_result", wrapped)

    def ended_in_verify_row(self, request_id: str, output: list[int]) -> int:
        """How many of its last verify row's tokens were dropped after its end (-1: it did not end in one)."""
        rows = self.rows.get(request_id, [])
        total = sum(len(t) for _, t in rows)
        if not rows or not rows[-1][0] or not total - len(rows[-1][1]) < len(output) <= total:
            return -1
        return total - len(output)


def test_stops_lengths_n_logprobs_and_structured_outputs_as_without(tmp_path, monkeypatch):
    from nanoserve import StructuredOutputsParams

    tiny = write_tiny_checkpoint(tmp_path, dataclasses.replace(FAMILIES["llama"], std=0.02))  # loops sooner
    engine = dict(max_model_len=200, num_kv_blocks=512, block_size=8)
    g = dict(temperature=0, ignore_eos=True)
    with LLM(str(tiny), **engine) as llm:
        tok = llm.tokenizer
        # prompts that end inside the model's own loops, so drafts come from the first output on
        base = llm.generate(_prompts(500)[:3], SamplingParams(**g, max_tokens=30), use_tqdm=False)
        prompts = [o.prompt_token_ids + o.outputs[0].token_ids for o in base]
        ahead = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**g, max_tokens=12), False)]
        batch, params = [], []
        for prompt, out in zip(prompts, ahead):
            for t in dict.fromkeys(out[1:6]):  # stop ids the drafts reach: each ends its request at its first
                batch.append(prompt)
                params.append(SamplingParams(**g, max_tokens=40, stop_token_ids=[t]))
            for first, last in ((2, 6), (3, 5), (1, 9)):  # stop strings over a few tokens of the loop
                batch.append(prompt)
                params.append(SamplingParams(**g, max_tokens=40, stop=[tok.decode(out[first:last])]))
            for m in (3, 6, 9, 14):
                batch.append(prompt)
                params.append(SamplingParams(**g, max_tokens=m))
            batch += [prompt, prompt]
            params += [SamplingParams(**g, max_tokens=17, logprobs=2), SamplingParams(**g, max_tokens=13, n=2)]
            # sampled (the worker's rejection sampler): only the shape of the output compares
            batch.append(prompt)
            params.append(SamplingParams(temperature=0.5, top_k=2, seed=7, max_tokens=25, ignore_eos=True))
        batch.append(prompts[0])
        so = StructuredOutputsParams(regex="[ab]{2,4}-[0-9]")
        params.append(SamplingParams(temperature=0, max_tokens=20, structured_outputs=so))
        want = llm.generate(batch, params, use_tqdm=False)
    rows = _Rows(monkeypatch)
    with LLM(str(tiny), **engine, speculative_config={**SPEC, "disable_by_batch_size": 64}) as llm:
        got = llm.generate(batch, params, use_tqdm=False)
        stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for w, o, p in zip(want, got, params):
        if p.temperature > 0:
            assert len(o.outputs[0].token_ids) == 25 and o.outputs[0].finish_reason == "length"
            continue
        for wo, go in zip(w.outputs, o.outputs, strict=True):
            assert_same_completion(wo, go, p)
    # not vacuous: stop ids and stop strings ended requests inside verify rows (tokens after them dropped), max_tokens
    # was reached by a verify row, a request with logprobs had verify rows, a structured one none
    dropped = {"ids": [], "strings": [], "max_tokens": []}
    for o, p in zip(got, params):
        kind = "ids" if p.stop_token_ids else "strings" if p.stop else "max_tokens" if p.max_tokens < 15 else None
        if kind and p.n == 1 and p.logprobs is None:
            dropped[kind].append(rows.ended_in_verify_row(o.request_id, o.outputs[0].token_ids))
    assert max(dropped["ids"]) > 0 and max(dropped["strings"]) > 0, dropped
    assert max(dropped["max_tokens"]) == 0, dropped  # never past max_tokens: drafts are capped to fit
    assert any(v for o, p in zip(got, params) if p.logprobs for v, _ in rows.rows[o.request_id])
    assert any(v for o, p in zip(got, params) if p.temperature > 0 for v, _ in rows.rows[o.request_id])
    assert not any(v for v, _ in rows.rows[got[-1].request_id])


def test_a_verify_rows_sequence_is_scheduled_again_at_once(tmp_path):
    """Inside loops (nearly every draft accepted), three sequences take far fewer steps than tokens: a sequence
    whose verify row is in flight is back in the next step (its result read first), not async_depth steps later."""
    tiny = write_tiny_checkpoint(tmp_path, dataclasses.replace(FAMILIES["llama"], std=0.02))
    g = dict(temperature=0, ignore_eos=True)
    with LLM(str(tiny), max_model_len=200, num_kv_blocks=128, block_size=8, speculative_config=SPEC) as llm:
        base = llm.generate(_prompts(500), SamplingParams(**g, max_tokens=30, min_tokens=30), use_tqdm=False)
        looping = [o.prompt_token_ids + o.outputs[0].token_ids for o in base]
        before = llm.stats()
        llm.generate(looping, SamplingParams(**g, max_tokens=40), use_tqdm=False)
        after = llm.stats()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert accepted > 0.7 * drafted
    assert after["steps"] - before["steps"] < 0.6 * 40


def test_config_refused_by_key(tiny_tied):
    with pytest.raises(EngineArgError, match=r"speculative_config\.prompt_lookup_mn: unknown key") as e:
        LLM(str(tiny_tied), speculative_config={**SPEC, "prompt_lookup_mn": 2})
    assert e.value.name == "speculative_config"
    with pytest.raises(EngineArgError, match=r"speculative_config\.num_speculative_tokens must be an integer >= 1"):
        LLM(str(tiny_tied), speculative_config={**SPEC, "num_speculative_tokens": -1})
    # eagle3 (tests/engine/test_speculative_eagle3.py): a target checkpoint is no draft
    eagle = {"method": "eagle3", "model": str(tiny_tied), "num_speculative_tokens": 3}
    with pytest.raises(EngineArgError, match=r"speculative_config\.model: .* is not an EAGLE-3 draft"):
        LLM(str(tiny_tied), speculative_config=eagle)


def test_the_benchmark_switch_accepts_every_draft(tiny_tied, monkeypatch):
    """NANOSERVE_BENCH_ACCEPT_DRAFTS=1 (speculation's ceiling, benchmark only): every try drafts k tokens, every
    draft is kept, so a sequence takes about one step per k + 1 tokens."""
    monkeypatch.setenv("NANOSERVE_BENCH_ACCEPT_DRAFTS", "1")
    with LLM(str(tiny_tied), max_model_len=200, num_kv_blocks=64, block_size=8, speculative_config=SPEC) as llm:
        before = llm.stats()
        out = llm.generate([_prompts()[1]], SamplingParams(temperature=0, max_tokens=41, ignore_eos=True))
        stats = llm.stats()
    assert len(out[0].outputs[0].token_ids) == 41
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert (
        drafted > 0 and stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] == drafted
    )
    assert stats["steps"] - before["steps"] <= 41 // 4 + 4
