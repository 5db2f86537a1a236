"""Small builders shared by tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from protocol.messages import StepCommand
from protocol.sampling_params import SamplingParams

# An engine on the GPU with its KV pool sized, not profiled: profiling counts every process's memory on the device,
# so GPU test files run side by side (pytest -n) would leave each other no KV cache.
GPU_ENGINE = {"device": "cuda", "num_kv_blocks": 512}


def i32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


def make_step(
    seqs: list[dict],
    step_id: int = 0,
    freed: list[int] = (),
) -> StepCommand:
    """seqs: dicts with slot, tokens, new_blocks (and sample=False for a row whose last token is not sampled);
    for a sequence new to its slot: start, its SamplingParams fields (temperature defaults to 0 here; max_tokens
    is raised to fit min_tokens), and what only the coordinator knows: penalty_prompt (the prompt ids a
    repetition penalty needs) and outputs (the output ids it already has, after a preemption). Rows with several
    tokens must come first (prefill-first, as the scheduler sends them)."""
    lens = [len(s["tokens"]) for s in seqs]
    num_prefills = next((i for i, n in enumerate(lens) if n == 1), len(lens))
    assert all(n == 1 for n in lens[num_prefills:]), "multi-token rows must come first"
    new = [s for s in seqs if "start" in s]
    return StepCommand(
        step_id=step_id,
        slots=i32([s["slot"] for s in seqs]),
        prefill_num_tokens=i32(lens[:num_prefills]),
        token_ids=i32([t for s in seqs for t in s["tokens"]]),
        new_block_counts=i32([len(s.get("new_blocks", [])) for s in seqs]),
        new_block_ids=i32([b for s in seqs for b in s.get("new_blocks", [])]),
        skip_sample_rows=i32([i for i, s in enumerate(seqs) if not s.get("sample", True)]),
        new_slots=i32([s["slot"] for s in new]),
        new_start_pos=i32([s["start"] for s in new]),
        new_params=[sampling_params(s) for s in new],
        new_num_outputs=i32([len(s.get("outputs", [])) for s in new]),
        new_prompt_lens=i32([len(s.get("penalty_prompt", [])) for s in new]),
        new_past_token_ids=i32([t for s in new for t in [*s.get("penalty_prompt", []), *s.get("outputs", [])]]),
        freed_slots=i32(freed),
    )


def sampling_params(seq: dict) -> SamplingParams:
    """The SamplingParams fields of a make_step dict (greedy unless it says otherwise)."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    kw = {k: v for k, v in seq.items() if k in names}
    kw.setdefault("temperature", 0.0)
    kw["max_tokens"] = max(kw.get("max_tokens", 16), kw.get("min_tokens", 0))
    return SamplingParams(**kw)


def vllm_penalized(logits, prompt_tokens, output_tokens, presence: float, frequency: float, repetition: float):
    """vLLM's penalties in float64 numpy, per token: a token seen in the prompt or the output has its logit
    divided by ``repetition`` when positive, multiplied otherwise; then ``frequency * count`` and
    ``presence * (count > 0)`` over the output are subtracted."""
    out = np.asarray(logits, dtype=np.float64).copy()
    counts = np.bincount(np.asarray(output_tokens, dtype=np.int64), minlength=len(out))
    seen = counts > 0
    seen[np.asarray(list(prompt_tokens), dtype=np.int64)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    return out - frequency * counts - presence * (counts > 0)


def worker_config(model_dir, **kw):
    from protocol.messages import WorkerConfig

    base = dict(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        load_format="auto",
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=256,
        num_kv_blocks=64,
        gpu_memory_utilization=0.9,
        kv_cache_memory_bytes=1 << 26,
        enforce_eager=True,
        seed=0,
        attention_backend="torch",
        dist_init_method="",
    )
    base.update(kw)
    return WorkerConfig(**base)
