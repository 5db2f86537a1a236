"""Small builders shared by tests."""

from __future__ import annotations

import numpy as np

from protocol.messages import StepCommand


def i32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


def make_step(
    seqs: list[dict],
    step_id: int = 0,
    freed: list[int] = (),
) -> StepCommand:
    """seqs: dicts with slot, tokens, new_blocks, and for a sequence new to its slot: start, temperature..."""
    new = [s for s in seqs if "start" in s]
    return StepCommand(
        step_id=step_id,
        slots=i32([s["slot"] for s in seqs]),
        num_tokens=i32([len(s["tokens"]) for s in seqs]),
        token_ids=i32([t for s in seqs for t in s["tokens"]]),
        new_block_counts=i32([len(s.get("new_blocks", [])) for s in seqs]),
        new_block_ids=i32([b for s in seqs for b in s.get("new_blocks", [])]),
        sample_rows=i32([i for i, s in enumerate(seqs) if s.get("sample", True)]),
        new_slots=i32([s["slot"] for s in new]),
        new_start_pos=i32([s["start"] for s in new]),
        new_temperature=np.asarray([s.get("temperature", 0.0) for s in new], np.float32),
        new_top_p=np.asarray([s.get("top_p", 1.0) for s in new], np.float32),
        new_top_k=i32([s.get("top_k", 0) for s in new]),
        new_min_p=np.asarray([s.get("min_p", 0.0) for s in new], np.float32),
        new_seed=np.asarray([s.get("seed", -1) for s in new], np.int64),
        freed_slots=i32(freed),
    )


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
