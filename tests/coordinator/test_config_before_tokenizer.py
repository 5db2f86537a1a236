"""The engine sends the workers their config before it loads the tokenizer (transformers' import took 8-15 s of a
GPU host's start, all of it ahead of the config before: log 53c), and the EOS ids follow in AllocateKV. Real
worker processes; the order is recorded around the real calls. A tokenizer that fails to load after the config
went out stops the workers already loading."""

from __future__ import annotations

import os
import time

import pytest

import coordinator.engine
from coordinator.worker_group import WorkerGroup
from nanoserve.llm import LLM
from protocol.sampling_params import SamplingParams
from tests.support.processes import children_of
from tests.support.timeouts import HANG_S


def _record(monkeypatch, events: list[str]) -> None:
    send_config, load_tokenizer = WorkerGroup._send_config, coordinator.engine.load_tokenizer

    def recorded_send_config(self, worker_config):
        events.append("config")
        return send_config(self, worker_config)

    def recorded_load_tokenizer(source):
        events.append("tokenizer")
        return load_tokenizer(source)

    monkeypatch.setattr(WorkerGroup, "_send_config", recorded_send_config)
    monkeypatch.setattr(coordinator.engine, "load_tokenizer", recorded_load_tokenizer)


def test_the_config_leaves_before_the_tokenizer_loads_and_eos_still_masks(tiny_tied, monkeypatch):
    events: list[str] = []
    _record(monkeypatch, events)
    with LLM(str(tiny_tied), device="cpu", num_kv_blocks=64, max_model_len=256) as llm:
        assert events == ["config", "tokenizer"]
        eos = sorted(llm.engine.eos_token_ids)[0]
        # min_tokens masks EOS in the workers' sampler: its ids came with AllocateKV
        params = SamplingParams(temperature=1.0, max_tokens=6, min_tokens=6, seed=0, logit_bias={eos: 100.0})
        out = llm.generate("hello", params, use_tqdm=False)[0]
        assert eos not in out.outputs[0].token_ids and len(out.outputs[0].token_ids) == 6


def test_a_tokenizer_that_fails_after_the_config_stops_the_workers(tiny_tied, monkeypatch):
    before = set(children_of(os.getpid()))

    def broken(source):
        raise ValueError(f"no tokenizer at {source}")

    monkeypatch.setattr(coordinator.engine, "load_tokenizer", broken)
    with pytest.raises(ValueError, match="no tokenizer at"):
        LLM(str(tiny_tied), device="cpu", num_kv_blocks=64, max_model_len=256)
    deadline = time.monotonic() + HANG_S
    while set(children_of(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(children_of(os.getpid())) - before, "workers left running"
