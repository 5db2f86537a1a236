"""Structured outputs end to end through ``client.LLM`` (real worker processes, xgrammar's matchers in the
coordinator): greedy decoding under a grammar equals HF transformers' greedy decoding over the tokens the same
grammar allows (masked by xgrammar's own ``apply_token_bitmask_inplace``: the oracle), with async scheduling on and
off, and leaves an unconstrained request of the same batch alone; sampled outputs of choices, regexes and JSON
schemas are valid; a spec that does not compile is refused naming the field, and the engine keeps serving."""

from __future__ import annotations

import functools
import json
import re
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from protocol.errors import RequestError
from tests.support.builders import GPU_ENGINE
from tests.support.oracle import assert_greedy_equal_up_to_ties, hf_greedy, prompts_with_shared_prefixes
from tests.support.timeouts import HANG_S

xgr = pytest.importorskip("xgrammar")  # a core dependency; absent from bare GPU images

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
SPECS = [
    {"choice": ["yes", "no", "maybe not"]},
    {"regex": "[ab]{2,4}-[0-9]"},
    {"json": SCHEMA},
    {"grammar": 'root ::= "x" [0-9] ("," [0-9])?'},
]
ENGINE = dict(max_model_len=256, num_kv_blocks=128, block_size=16)


def _grammar(compiler, spec: dict):
    ((kind, value),) = spec.items()
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
    if kind == "choice":
        return compiler.compile_regex("|".join(re.escape(c) for c in value))
    if kind == "regex":
        return compiler.compile_regex(value)
    return compiler.compile_grammar(value)


@functools.cache
def _hf_and_compiler(model_dir: str):
    """HF's model and tokenizer and an xgrammar compiler over its vocabulary: built once per checkpoint."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=model.config.vocab_size, stop_token_ids=[tok.eos_token_id]
    )
    return tok, model, xgr.GrammarCompiler(info)


@functools.cache
def _constrained_greedy(model_dir: str, prompt: tuple[int, ...], spec_json: str, max_tokens: int) -> tuple[int, ...]:
    tok, model, compiler = _hf_and_compiler(model_dir)
    vocab = model.config.vocab_size
    matcher = xgr.GrammarMatcher(_grammar(compiler, json.loads(spec_json)))
    ids, out = list(prompt), []
    mask = xgr.allocate_token_bitmask(1, vocab)
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            token = int(logits.argmax())
            out.append(token)
            if token == tok.eos_token_id:
                break
            assert matcher.accept_token(token)
            ids.append(token)
    return tuple(out)


def hf_constrained_greedy(model_dir, prompt: list[int], spec: dict, max_tokens: int) -> list[int]:
    """HF's greedy tokens, each step's logits masked by a fresh xgrammar matcher of ``spec``; ends on EOS. Each
    (checkpoint, prompt, spec) runs once per test process: the tests below ask for the same ones."""
    return list(_constrained_greedy(str(model_dir), tuple(prompt), json.dumps(spec, sort_keys=True), max_tokens))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_under_a_grammar_equals_hf_over_the_same_mask(tiny_untied, async_scheduling):
    prompts = prompts_with_shared_prefixes()[:5]
    with LLM(str(tiny_untied), async_scheduling=async_scheduling, **ENGINE) as llm:
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in SPECS]
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, [*params, plain], use_tqdm=False)
    expected = [hf_constrained_greedy(tiny_untied, p, spec, 40) for p, spec in zip(prompts, SPECS)]
    # a near-tie of two allowed tokens may break the other way under another summation order
    assert_greedy_equal_up_to_ties(tiny_untied, prompts[:4], [o.outputs[0].token_ids for o in outs[:4]], expected)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:4])  # each grammar ends well before 40 tokens
    assert outs[-1].outputs[0].token_ids == hf_greedy(tiny_untied, prompts[-1:], 12)[0]


def test_a_preempted_constrained_request_resumes_its_grammar(tiny_untied):
    """9 blocks for 8 requests: one is preempted (its in-flight tokens still reach its grammar, in order) and
    recomputed; every output still equals HF's under its grammar."""
    prompts, specs = prompts_with_shared_prefixes()[:8], SPECS * 2
    with LLM(str(tiny_untied), max_model_len=256, num_kv_blocks=9, block_size=16) as llm:
        # grammars compile on threads and a request joins when its grammar is ready: compiled (and cached) first,
        # all 8 join at once and so compete for the blocks
        llm.generate(prompts[:4], [SamplingParams(max_tokens=1, structured_outputs=s) for s in SPECS], use_tqdm=False)
        before = llm.stats()["preemptions"]
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in specs]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["preemptions"] > before
    expected = [hf_constrained_greedy(tiny_untied, p, spec, 40) for p, spec in zip(prompts, specs)]
    assert_greedy_equal_up_to_ties(tiny_untied, prompts, [o.outputs[0].token_ids for o in outs], expected)


def test_tensor_parallel_ranks_sample_under_late_masks_and_exit_cleanly(tiny_untied):
    """TP=2 (gloo): rank 0 samples masked steps, whose bitmasks arrive after their forward; the other rank waits
    in the broadcast. Steps still in flight at shutdown complete, so both ranks exit cleanly."""
    prompts = prompts_with_shared_prefixes()[:4]
    with LLM(str(tiny_untied), tensor_parallel_size=2, device="cpu", **ENGINE) as llm:
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in SPECS]
        outs = llm.generate(prompts, params, use_tqdm=False)
        procs = llm.engine.workers.procs
    expected = [hf_constrained_greedy(tiny_untied, p, spec, 40) for p, spec in zip(prompts, SPECS)]
    assert_greedy_equal_up_to_ties(tiny_untied, prompts, [o.outputs[0].token_ids for o in outs], expected)
    assert [p.wait(timeout=HANG_S) for p in procs] == [0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_grammars_on_cuda_equal_hf_and_sampled_rows_stay_valid(tiny_untied, enforce_eager):
    """The CUDA sampler: masks before the fused sampling kernel, under CUDA graphs too."""
    prompts = prompts_with_shared_prefixes()[:5]
    kw = {**ENGINE, **GPU_ENGINE, "enforce_eager": enforce_eager}
    with LLM(str(tiny_untied), **kw) as llm:
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in SPECS]
        sampled = SamplingParams(temperature=1.0, max_tokens=40, n=4, seed=5, structured_outputs=SPECS[1])
        outs = llm.generate(prompts, [*params, sampled], use_tqdm=False)
    expected = [hf_constrained_greedy(tiny_untied, p, spec, 40) for p, spec in zip(prompts, SPECS)]
    # float32 with tf32 dots on CUDA: HF's tokens up to a near-tie
    assert_greedy_equal_up_to_ties(tiny_untied, prompts[:4], [o.outputs[0].token_ids for o in outs[:4]], expected)
    assert all(re.fullmatch("[ab]{2,4}-[0-9]", c.text) for c in outs[-1].outputs), [c.text for c in outs[-1].outputs]


def test_sampled_outputs_are_valid_and_a_bad_spec_is_refused(tiny_tied):
    with LLM(str(tiny_tied), **ENGINE) as llm:
        sampled = dict(temperature=1.0, max_tokens=60, n=3, seed=11)
        choice, regex, schema, obj = llm.generate(
            ["pick", "match", "json", "object"],
            [
                SamplingParams(**sampled, structured_outputs=SPECS[0]),
                SamplingParams(**sampled, structured_outputs=SPECS[1]),
                SamplingParams(**sampled, structured_outputs=SPECS[2]),
                SamplingParams(temperature=1.0, max_tokens=200, seed=3, structured_outputs={"json_object": True}),
            ],
            use_tqdm=False,
        )
        assert {c.text for c in choice.outputs} <= {"yes", "no", "maybe not"}
        assert all(re.fullmatch("[ab]{2,4}-[0-9]", c.text) for c in regex.outputs), [c.text for c in regex.outputs]
        for c in schema.outputs:
            value = json.loads(c.text)
            assert set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue")
            assert isinstance(value["ok"], bool)
        # seeded, so the same in any batch: this one closes its object after 134 tokens
        assert obj.outputs[0].finish_reason == "stop" and isinstance(json.loads(obj.outputs[0].text), dict)
        for bad, field in (({"regex": "(unclosed"}, "regex"), ({"json": {"type": "nonsense"}}, "json")):
            with pytest.raises(RequestError, match=f"structured_outputs.{field}"):
                llm.generate("x", SamplingParams(structured_outputs=bad), use_tqdm=False)
        with pytest.raises(ValueError, match="exactly one of"):
            SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
        vllm_style = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        again = llm.generate("pick", vllm_style, use_tqdm=False)  # the engine kept serving
        assert again[0].outputs[0].text in ("yes", "no")
        assert vllm_style.structured_outputs == '{"choice": ["yes", "no"]}'


class _GatedCompiler:
    """xgrammar's compiler behind a gate the test opens: a compile as slow as the test wants, on the real pool."""

    def __init__(self, compiler, fail: bool = False) -> None:
        self.compiler, self.fail, self.gate = compiler, fail, threading.Event()

    def compile_grammar(self, grammar):
        assert self.gate.wait(HANG_S)
        if self.fail:
            raise RuntimeError("compiler failed")
        return self.compiler.compile_grammar(grammar)


def _finish(engine, until) -> dict:
    done = {}
    while not until(done):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_engine_serves_others_while_a_grammar_compiles(tiny_tied, async_scheduling):
    with LLM(str(tiny_tied), async_scheduling=async_scheduling, **ENGINE) as llm:
        engine, grammars = llm.engine, llm.engine.grammars
        llm.generate("x", SamplingParams(max_tokens=2, structured_outputs={"regex": "c+"}), use_tqdm=False)
        gated = grammars._compiler = _GatedCompiler(grammars._compiler)  # the real one, built by that request
        choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})
        engine.add_request("pick", choice, request_id="constrained")
        engine.add_request("again", choice, request_id="same spec")  # shares the compile
        engine.add_request("x", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id="plain")
        engine.add_request("y", SamplingParams(structured_outputs={"regex": "a+"}), request_id="aborted")
        assert engine.abort("aborted").finish_reason == "abort"  # aborted while compiling
        assert len(grammars._compiling) == 1  # only the choice's compile is still wanted
        done = _finish(engine, lambda d: "plain" in d)
        assert len(done["plain"].token_ids) == 6 and not {"constrained", "same spec"} & set(done)
        gated.gate.set()
        done = _finish(engine, lambda d: not engine.has_unfinished)
        assert {done["constrained"].text, done["same spec"].text} <= {"yes", "no"}, done
        assert done["constrained"].finish_reason == "stop" and "aborted" not in done
        # a compile that fails ends its request ("abort"); the engine keeps serving
        failing = grammars._compiler = _GatedCompiler(gated.compiler, fail=True)
        failing.gate.set()
        engine.add_request("z", SamplingParams(structured_outputs={"regex": "b+"}), request_id="failed")
        assert _finish(engine, lambda d: "failed" in d)["failed"].finish_reason == "abort"
        assert llm.generate("pick", choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")  # cached spec
