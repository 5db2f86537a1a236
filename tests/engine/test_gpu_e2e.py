"""On CUDA: the full engine (Triton kernels, CUDA graphs) against HF transformers on the same checkpoint.
float32: greedy tokens identical. bf16: teacher-forced logits within bf16 tolerance."""

import functools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from model.tiny import TinySpec, write_tiny_checkpoint
from nanoserve import LLM, SamplingParams
from tests.support.builders import GPU_ENGINE, make_step, worker_config
from tests.support.controls import MAX_TOKENS, check_completion, params_for
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes
from worker.startup import capture_graphs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_tokens_match_hf(tiny_untied, enforce_eager):
    prompts = prompts_with_shared_prefixes()
    expected = hf_greedy(tiny_untied, prompts, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(tiny_untied), **GPU_ENGINE, max_model_len=256, enforce_eager=enforce_eager, max_num_seqs=16) as llm:
        got = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_penalties_min_tokens_logprobs_on_cuda(tiny_tied, enforce_eager):
    """The sampling controls on the device (decode steps through CUDA graphs when not eager, sampling outside
    them): penalized greedy tokens and raw logprobs against HF, min_tokens bans, pinned logprob copies."""
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()

    def hf(prompt, output):
        with torch.no_grad():
            return model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :].double().numpy()

    prompts = prompts_with_shared_prefixes()
    params = [params_for(i) for i in range(len(prompts))]
    with LLM(str(tiny_tied), **GPU_ENGINE, max_model_len=256, enforce_eager=enforce_eager, max_num_seqs=16) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        plain = llm.generate(prompts[0], greedy, use_tqdm=False)[0]
        banned = plain.token_ids[:2]
        masked = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=banned, logprobs=2)
        held = llm.generate(prompts[0], masked, use_tqdm=False)[0]
    for prompt, p, comp in zip(prompts, params, got):
        check_completion(hf, prompt, p, comp, tol=1e-2)
    assert not set(banned) & set(held.token_ids) and len(held.logprobs) == 8


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    spec = TinySpec(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
        dtype="bfloat16",
        std=0.05,
        tie_word_embeddings=False,
    )
    return write_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), spec)


def test_bf16_teacher_forced_logits_close_to_hf(bf16_ckpt):
    from worker.model_runner import ModelRunner

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (200, 33, 1)]
    runner = ModelRunner(
        worker_config(bf16_ckpt, dtype="bfloat16", attention_backend="triton", device="cuda", max_model_len=512),
        torch.device("cuda"),
    )
    runner.allocate_kv(64)
    steps = [
        dict(slot=i, tokens=p, start=0, new_blocks=list(range(i * 16, (i + 1) * 16))) for i, p in enumerate(prompts)
    ]
    steps.sort(key=lambda s: len(s["tokens"]) == 1)
    ours = runner.forward_logits(make_step(steps)).float()
    hf = AutoModelForCausalLM.from_pretrained(bf16_ckpt, dtype=torch.bfloat16).cuda().eval()
    offset = 0
    for s in steps:
        n = len(s["tokens"])
        with torch.no_grad():
            ref = hf(torch.tensor([s["tokens"]], device="cuda")).logits[0].float()
        mine = ours[offset : offset + n]
        offset += n
        rel = ((mine - ref).norm() / ref.norm()).item()
        top1 = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert rel < 2e-2, rel
        assert top1 > 0.9, top1


def test_bf16_decode_graphs_on_cublaslt_choices_close_to_hf(bf16_ckpt, monkeypatch):
    """Decode steps replayed from CUDA graphs whose layer products run cuBLASLt's chosen algorithms (every product
    forced onto its fastest candidate, however small the gain) give HF's teacher-forced logits within bf16
    tolerance."""
    from kernels import cublaslt_tune
    from worker.model_runner import ModelRunner

    monkeypatch.setattr(cublaslt_tune, "tune", functools.partial(cublaslt_tune.tune, min_gain=-1.0))
    monkeypatch.delenv("NANOSERVE_LT_TUNE", raising=False)
    rng = np.random.default_rng(2)
    # 20 sequences: the decode graph of 32 rows, where cuBLAS (not our <= 16-row kernels) takes every product
    prompts = [rng.integers(0, 500, n).tolist() for n in rng.integers(1, 40, 20)]
    forced = [rng.integers(0, 500, 6).tolist() for _ in prompts]
    cublaslt_tune._chosen.clear()
    try:
        cfg = worker_config(
            bf16_ckpt,
            dtype="bfloat16",
            attention_backend="triton",
            device="cuda",
            max_model_len=512,
            max_num_seqs=32,
            enforce_eager=False,
        )
        runner = ModelRunner(cfg, torch.device("cuda"))
        runner.allocate_kv(64)
        capture_graphs(runner)
        assert any(rows == 32 for rows, *_ in cublaslt_tune._chosen) and runner.graphs is not None
        first = [
            dict(slot=i, tokens=p, start=0, new_blocks=[3 * i, 3 * i + 1, 3 * i + 2]) for i, p in enumerate(prompts)
        ]
        first.sort(key=lambda s: len(s["tokens"]) == 1)  # multi-token rows first
        runner.forward_logits(make_step(first))
        ours = [
            runner.forward_logits(make_step([dict(slot=i, tokens=[f[j]]) for i, f in enumerate(forced)], step_id=j + 1))
            for j in range(len(forced[0]))
        ]
    finally:
        cublaslt_tune._chosen.clear()
    hf = AutoModelForCausalLM.from_pretrained(bf16_ckpt, dtype=torch.bfloat16).cuda().eval()
    for i, (p, f) in enumerate(zip(prompts, forced)):
        with torch.no_grad():
            ref = hf(torch.tensor([p + f], device="cuda")).logits[0, len(p) :].float()
        mine = torch.stack([step[i] for step in ours]).float()
        rel = ((mine - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel
        assert (mine.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


def test_prefill_graphs_match_eager_on_mixed_steps(tiny_untied):
    """Steps with prefill tokens through the whole-forward prefill graphs (padded up to a token bucket, each
    layer's attention one whole-step launch over the graphs' static layout) give the eager forward's logits: a
    first prefill of two prompts, then a step that mixes a new prompt with decode rows over the cached context."""
    from worker.model_runner import ModelRunner

    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 500, n).tolist() for n in (40, 20, 300))
    steps = [
        [dict(slot=0, tokens=a, start=0, new_blocks=[0, 1, 2, 3]), dict(slot=1, tokens=b, start=0, new_blocks=[4, 5])],
        [
            dict(slot=2, tokens=c, start=0, new_blocks=list(range(6, 26))),
            dict(slot=0, tokens=[7]),
            dict(slot=1, tokens=[9]),
        ],
    ]
    logits = {}
    for eager in (True, False):
        cfg = worker_config(
            tiny_untied,
            device="cuda",
            attention_backend="triton",
            enforce_eager=eager,
            max_num_batched_tokens=512,
            max_model_len=512,
        )
        runner = ModelRunner(cfg, torch.device("cuda"))
        runner.allocate_kv(64)
        capture_graphs(runner)
        assert (runner.prefill_graphs is None) == eager
        if not eager:
            assert runner.prefill_graphs.buckets == [16, 32, 64, 128, 192, 256, 288, 320, 352, 384, 512]  # 60, 302
        logits[eager] = [runner.forward_logits(make_step(s, step_id=i)).float() for i, s in enumerate(steps)]
    # float32, but the Triton attention's dots round through tf32 (~1e-3), and the padded GEMMs' different row
    # counts perturb their inputs in the last bits: compare each row relative to its norm. A wrong row (stale
    # queries, a decode row read through the prefill path) is off by O(1).
    for got, want in zip(logits[False], logits[True]):
        assert got.shape == want.shape
        row_err = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert row_err.max().item() < 1e-2, row_err.max().item()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.98
