"""On CUDA: n-gram speculation through the real engine with CUDA graphs (a step of verify and decode rows replays
the decode graph, one row per token) and the Triton kernels. float32: greedy tokens with speculation equal HF's and
the engine's own without it, eager and with graphs, for a dense and a MoE family, with drafts accepted (tiny
loopy checkpoints, as in tests/engine/test_speculative.py)."""

from __future__ import annotations

import dataclasses

import pytest

from model.tiny import write_tiny_checkpoint
from nanoserve import LLM, SamplingParams
from tests.engine.test_speculative import LOOPY_STD, SPEC, _prompts
from tests.model.test_families import FAMILIES
from tests.support.builders import GPU_ENGINE
from tests.support.oracle import hf_greedy
from tests.support.tiny_moe import TinyMoeSpec, write_tiny_moe_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_with_drafts_equals_hf_on_cuda(tmp_path, family, enforce_eager):
    if family == "qwen3_moe":
        model_dir = write_tiny_moe_checkpoint(tmp_path, TinyMoeSpec(std=LOOPY_STD))
    else:
        model_dir = write_tiny_checkpoint(tmp_path, dataclasses.replace(FAMILIES[family], std=LOOPY_STD))
    prompts = _prompts(500)
    expected = hf_greedy(model_dir, prompts, 40)
    eng = dict(GPU_ENGINE, max_model_len=128, max_num_seqs=16, enforce_eager=enforce_eager)
    with LLM(str(model_dir), **eng, speculative_config=SPEC) as llm:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        got = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert got == expected
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
