"""Shutdown of a real ``client.LLM`` (coordinator in this process, a real worker process over ZMQ): ``close`` and
the ``with`` block leave no worker process or temporary directory behind, also on an exception; the start-up objects
frozen for the garbage collector are released at shutdown."""

from __future__ import annotations

import gc
import os

import pytest

from nanoserve import LLM, SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 16, 16
PROMPT = [5, 17, 42, 7, 99, 3]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def test_close_leaves_no_worker_behind(tiny_tied):
    llm = LLM(str(tiny_tied), device="cpu", num_kv_blocks=8)
    procs = list(llm.engine.workers.procs)
    tmpdir = llm.engine.workers.tmpdir
    assert len(procs) == 1 and all(p.poll() is None for p in procs)
    assert llm.generate(PROMPT, greedy(2), use_tqdm=False)[0].token_ids
    llm.close()
    assert all(p.poll() is not None for p in procs)
    assert all(_gone(p.pid) for p in procs)
    assert not os.path.exists(tmpdir)
    llm.close()  # idempotent


def test_with_block_closes_on_exception(tiny_tied):
    procs = []
    with pytest.raises(KeyError, match="boom"):
        with LLM(str(tiny_tied), device="cpu", num_kv_blocks=8) as llm:
            procs = list(llm.engine.workers.procs)
            assert all(p.poll() is None for p in procs)
            raise KeyError("boom")
    assert procs and all(p.poll() is not None and _gone(p.pid) for p in procs)
    assert llm.engine.closed


def test_engine_freezes_its_start_up_objects_until_shutdown(tiny_tied):
    # a full GC pass walks every tracked object: start-up's (tokenizer, one Block per KV block) are frozen once
    engine_llm = LLM(str(tiny_tied), device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    try:
        assert gc.get_freeze_count() > NUM_BLOCKS
        assert engine_llm.engine.block_manager.blocks[0] not in gc.get_objects()  # frozen: out of the collector's view
    finally:
        engine_llm.engine.shutdown()
    assert gc.get_freeze_count() == 0  # the interpreter's last collection may reach them again
