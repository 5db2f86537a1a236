"""Our Qwen3 on the paged cache vs HF transformers on the same float32 checkpoint (the oracle)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.builders import make_step, worker_config
from worker.model_runner import ModelRunner


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def runner(model_dir, block_size=16) -> ModelRunner:
    r = ModelRunner(worker_config(model_dir, block_size=block_size), torch.device("cpu"))
    r.allocate_kv(64)
    return r


def close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("fixture", ["tiny_tied", "tiny_untied"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_decode_and_continuation(fixture, block_size, request):
    model_dir = request.getfixturevalue(fixture)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (37, 5, 70)]
    refs = {i: hf_logits(model_dir, p) for i, p in enumerate(prompts)}
    r = runner(model_dir, block_size)
    blocks_per = 256 // block_size if block_size < 256 else 1
    tables = {i: list(range(i * blocks_per, (i + 1) * blocks_per))[::-1] for i in range(3)}  # scattered blocks

    # 1. batched prefill of different lengths (the first 30 tokens of seq 0, then it continues from its prefix)
    first = [
        dict(slot=0, tokens=prompts[0][:30], start=0, new_blocks=tables[0]),
        dict(slot=1, tokens=prompts[1][:-3], start=0, new_blocks=tables[1]),
        dict(slot=2, tokens=prompts[2][:-3], start=0, new_blocks=tables[2]),
    ]
    out = r.forward_logits(make_step(first))
    assert close(out[:30], refs[0][:30]) < 1e-4
    assert close(out[30 : 30 + 2], refs[1][:2]) < 1e-4
    assert close(out[32:], refs[2][:67]) < 1e-4

    # 2. a chunk that continues seq 0 from its cached prefix (start position 30), mixed with decodes
    mixed = [
        dict(slot=0, tokens=prompts[0][30:]),
        dict(slot=1, tokens=[prompts[1][-3]]),
        dict(slot=2, tokens=[prompts[2][-3]]),
    ]
    out = r.forward_logits(make_step(mixed))
    assert close(out[:7], refs[0][30:]) < 1e-4
    assert close(out[7], refs[1][-3]) < 1e-4
    assert close(out[8], refs[2][-3]) < 1e-4

    # 3. further decode steps through the paged cache
    for k in (-2, -1):
        out = r.forward_logits(make_step([dict(slot=1, tokens=[prompts[1][k]]), dict(slot=2, tokens=[prompts[2][k]])]))
        assert close(out[0], refs[1][k]) < 1e-4
        assert close(out[1], refs[2][k]) < 1e-4
