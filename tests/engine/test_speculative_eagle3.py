"""EAGLE-3 speculative decoding end to end through real worker processes, with tiny draft checkpoints written in the
public layout (tests/support/tiny_eagle3.py): greedy output with drafts is token for token the output without them
(Llama and Qwen3 targets, random drafts that accept next to nothing; a "copy" draft that does get accepted; tensor
parallelism 2 on gloo; a tight engine; stops, lengths, n and logprobs), the drafts the workers make are those of an
independent EAGLE-3 reference over HF transformers' hidden states (Llama, Qwen3 and Qwen3-MoE targets), seeded
sampling stays reproducible, and a draft that does not fit its target is refused at start, by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from coordinator.config import EngineArgError
from model.tiny import TinySpec, write_tiny_checkpoint
from nanoserve import LLM, SamplingParams
from tests.engine.test_speculative import LOOPY_STD, _prompts, assert_same_completion
from tests.engine.test_speculative import _spec_vs_plain as spec_vs_plain
from tests.model.test_families import FAMILIES
from tests.support.eagle3_reference import run_accepting_all
from tests.support.oracle import prompts_with_shared_prefixes
from tests.support.tiny_eagle3 import DraftSpec, write_tiny_eagle3
from tests.support.tiny_moe import TinyMoeSpec, write_tiny_moe_checkpoint

K = 3
ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=8)


def _eagle(draft_dir, **extra) -> dict:
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": K, **extra}


def _spec_vs_plain(llm: LLM, prompts, max_tokens: int = 30) -> dict:
    """test_speculative.py's check (min_tokens == max_tokens: no drafts), drafts required, not acceptance."""
    return spec_vs_plain(llm, prompts, max_tokens, accepted=False)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """A tied Qwen3 whose small weights make greedy decoding repeat its last token, and a copy draft (attention
    and MLP off, fc passing the embedding through, lm_head the target's embedding under a permuted d2t): its
    drafts are accepted."""
    root = tmp_path_factory.mktemp("eagle3_repeat")
    target = write_tiny_checkpoint(
        root / "t", TinySpec(tie_word_embeddings=True, seed=1, std=0.02, num_hidden_layers=4)
    )
    draft = write_tiny_eagle3(root / "d", target, DraftSpec(copy=True, aux_layer_ids=[0, 2, 3]))
    return target, draft


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_unchanged_with_random_drafts(name, tmp_path):
    # 4 layers: the default aux layers (2, L // 2, L - 3) apply; a draft vocabulary of 300 of the 509 ids (d2t)
    target_spec = dataclasses.replace(FAMILIES[name], std=LOOPY_STD, num_hidden_layers=4)
    target = write_tiny_checkpoint(tmp_path / "t", target_spec)
    # the Qwen3 draft: its own embedding, and its layer named model.layers.0.* (as converted checkpoints name it)
    own = dict(embed=True, layer_prefix="model.layers.0.") if name == "qwen3" else {}
    draft = write_tiny_eagle3(tmp_path / "d", target, DraftSpec(draft_vocab_size=300, **own))
    with LLM(str(target), **ENGINE, speculative_config=_eagle(draft)) as llm:
        _spec_vs_plain(llm, _prompts(500))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_copy_draft_is_accepted_and_exact(repeating, async_scheduling):
    target, draft = repeating
    with LLM(str(target), **ENGINE, async_scheduling=async_scheduling, speculative_config=_eagle(draft)) as llm:
        stats = _spec_vs_plain(llm, _prompts(500))
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * stats["spec_decode_num_draft_tokens"], stats
    assert len(per_pos) == K and per_pos[-1] > 0


def test_greedy_unchanged_tp2(repeating):
    """Each rank runs its own replica of the draft (the embedding, shared with a sharded target, read whole from the
    target's checkpoint): the same drafts on both ranks, or the target's forward would mix two inputs."""
    target, draft = repeating
    with LLM(str(target), tensor_parallel_size=2, device="cpu", **ENGINE, speculative_config=_eagle(draft)) as llm:
        stats = _spec_vs_plain(llm, _prompts(500))
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_greedy_unchanged_tight_engine(repeating):
    # preemption, chunked prefill and prefix-cache hits, with drafts in the crowded batch too
    target, draft = repeating
    tight = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)
    with LLM(str(target), **tight, speculative_config=_eagle(draft, disable_by_batch_size=16)) as llm:
        stats = _spec_vs_plain(llm, prompts_with_shared_prefixes(), 40)
    assert stats["preemptions"] > 0 and stats["chunked_prefill_steps"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_drafts_are_the_reference_eagle3s(name, tmp_path, monkeypatch):
    """Every draft kept (the benchmark switch): the output is the drafts themselves and the target's bonus tokens,
    which the reference (HF hidden states, a dense draft layer) reproduces token for token."""
    monkeypatch.setenv("NANOSERVE_BENCH_ACCEPT_DRAFTS", "1")
    layers, aux = {"llama": (4, None), "qwen3": (2, [0, 1, 1]), "qwen3_moe": (3, [1, 2, 0])}[name]
    if name == "qwen3_moe":
        target = write_tiny_moe_checkpoint(tmp_path / "t", TinyMoeSpec())
    else:
        target = write_tiny_checkpoint(tmp_path / "t", dataclasses.replace(FAMILIES[name], num_hidden_layers=layers))
    draft = write_tiny_eagle3(tmp_path / "d", target, DraftSpec(draft_vocab_size=400, aux_layer_ids=aux, std=0.3))
    prompt = np.random.default_rng(9).integers(0, 509, 21).tolist()
    with LLM(str(target), **ENGINE, async_scheduling=False, speculative_config=_eagle(draft)) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 12
    want = run_accepting_all(target, draft, prompt, 24, K, aux or (2, 2, 1))
    assert out[0].outputs[0].token_ids == want


def test_seeded_sampling_with_drafts(repeating):
    target, draft = repeating
    params = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    with LLM(str(target), **ENGINE, speculative_config=_eagle(draft)) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(_prompts(500), params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(_prompts(500), params, use_tqdm=False)]
        stats = llm.stats()
    assert first == again and all(len(t) == 30 for t in first)
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


MISFITS = {
    "architecture": (DraftSpec(config={"architectures": ["LlamaForCausalLM"]}), r"architectures .* is not an EAGLE-3"),
    "vocab_size": (DraftSpec(config={"vocab_size": 600}), r"vocab_size=600 but the target's vocab_size is 512"),
    "target_hidden_size": (DraftSpec(config={"target_hidden_size": 96}), r"target_hidden_size=96 but the target"),
    "missing_tensor": (
        DraftSpec(drop=("midlayer.self_attn.q_proj.weight",)),
        r"'midlayer.self_attn.q_proj.weight' is missing",
    ),
    "fc_shape": (
        DraftSpec(reshape={"fc.weight": (64, 128)}),
        r"'fc.weight' has shape \(64, 128\), the target needs \(64, 192\)",
    ),
    "d2t_missing": (DraftSpec(draft_vocab_size=100, drop=("d2t",)), r"tensor 'd2t' is missing"),
    "d2t_range": (DraftSpec(draft_vocab_size=100), None),
    "aux_layers": (DraftSpec(), r"eagle_aux_hidden_state_layer_ids \[2, 1, -1\] must be 3 target layers in 0..1"),
    "hidden_without_embedding": (
        DraftSpec(config={"hidden_size": 32, "target_hidden_size": 64}),
        r"no embed_tokens.weight, so the target's embedding is shared, but hidden_size=32",
    ),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_draft_that_does_not_fit_is_refused_by_name(case, tiny_tied, tmp_path):
    spec, pattern = MISFITS[case]
    if case != "aux_layers":
        spec = dataclasses.replace(spec, aux_layer_ids=[0, 1, 1])
    if case == "d2t_range":  # a d2t that sends draft id 99 to 99 + 500, past the target's 512 ids
        draft = write_tiny_eagle3(tmp_path / "d", tiny_tied, spec)
        _rewrite_d2t(draft)
        pattern = r"tensor 'd2t' maps draft ids outside the target vocabulary"
    else:
        draft = write_tiny_eagle3(tmp_path / "d", tiny_tied, spec)
    with pytest.raises(EngineArgError, match=r"speculative_config\.model: .*" + pattern) as e:
        LLM(str(tiny_tied), **ENGINE, speculative_config=_eagle(draft))
    assert e.value.name == "speculative_config"


def _rewrite_d2t(draft) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = str(draft / "model.safetensors")
    tensors = load_file(path)
    tensors["d2t"] = torch.full((100,), 500, dtype=torch.int64)
    save_file(tensors, path)


def test_eagle3_refuses_ngram_keys_and_needs_a_model(tiny_tied):
    with pytest.raises(EngineArgError, match=r"speculative_config\.prompt_lookup_max is an ngram setting"):
        LLM(str(tiny_tied), speculative_config={**_eagle(tiny_tied), "prompt_lookup_max": 3})
    with pytest.raises(EngineArgError, match=r"speculative_config\.model is required with method eagle3"):
        LLM(str(tiny_tied), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(EngineArgError, match=r"speculative_config\.model: "):
        LLM(str(tiny_tied), speculative_config=_eagle("/nonexistent/draft-dir"))


def test_stops_lengths_n_and_logprobs_as_without(repeating):
    """Through the copy draft's accepted runs: a stop string ends a request inside a run, max_tokens is never passed,
    n > 1 and logprobs (an accepted token's equals the non-speculative one) as without speculation."""
    target, draft = repeating
    g = dict(temperature=0, ignore_eos=True)
    prompts = _prompts(500)
    with LLM(str(target), **ENGINE) as llm:
        repeated = [
            llm.tokenizer.decode(o.outputs[0].token_ids[3:6])
            for o in llm.generate(prompts, SamplingParams(**g, max_tokens=8), False)
        ]
        batch, params = [], []
        for prompt, text in zip(prompts, repeated):
            batch += [prompt] * 5
            params += [
                SamplingParams(**g, max_tokens=30, stop=[text]),
                SamplingParams(**g, max_tokens=6),
                SamplingParams(**g, max_tokens=11),
                SamplingParams(**g, max_tokens=9, n=2),
                SamplingParams(**g, max_tokens=14, logprobs=2),
            ]
        want = llm.generate(batch, params, use_tqdm=False)
    with LLM(str(target), **ENGINE, speculative_config=_eagle(draft)) as llm:
        got = llm.generate(batch, params, use_tqdm=False)
        stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for w, o, p in zip(want, got, params):
        for wo, go in zip(w.outputs, o.outputs, strict=True):
            assert_same_completion(wo, go, p)
