"""coordinator/config.py: a bad engine argument is refused by name before any worker process starts."""

from __future__ import annotations

import pytest

import coordinator.engine
from client import LLM
from coordinator.config import EngineArgError, EngineConfig


@pytest.mark.parametrize(
    "kwargs, name, message",
    [
        (dict(dtype="float33"), "dtype", "dtype must be one of auto, bfloat16, .*got 'float33'"),
        (dict(attention_backend="cudnn"), "attention_backend", "attention_backend must be one of auto, torch, triton"),
        (dict(device="tpu"), "device", "device must be cpu or cuda, got 'tpu'"),
        (dict(load_format="pt"), "load_format", "load_format must be auto or dummy"),
        (dict(external_workers=True), "worker_address", "worker_address is required with external_workers"),
        (dict(worker_timeout_s=0), "worker_timeout_s", "worker_timeout_s must be > 0"),
    ],
)
def test_bad_value_is_refused_before_any_worker_starts(tiny_tied, monkeypatch, kwargs, name, message):
    def no_workers(*args, **kw):
        raise AssertionError("a worker group was started")

    monkeypatch.setattr(coordinator.engine, "WorkerGroup", no_workers)
    with pytest.raises(EngineArgError, match=message) as e:
        LLM(str(tiny_tied), **kwargs)
    assert e.value.name == name


def test_too_few_gpus_for_the_spawned_workers_are_refused_by_name(tiny_tied, monkeypatch):
    import torch

    def no_workers(*args, **kw):
        raise AssertionError("a worker group was started")

    monkeypatch.setattr(coordinator.engine, "WorkerGroup", no_workers)
    found = torch.cuda.device_count()
    with pytest.raises(
        EngineArgError, match=rf"tensor_parallel_size={found + 1} needs {found + 1} GPU.*shows {found}"
    ) as e:
        LLM(str(tiny_tied), device="cuda", tensor_parallel_size=found + 1)
    assert e.value.name == ("device" if found == 0 else "tensor_parallel_size")


def test_every_value_of_a_fixed_set_is_accepted():
    for f in EngineConfig.__dataclass_fields__.values():
        for value in f.metadata["choices"]:
            assert getattr(EngineConfig(**{"device": "cpu", f.name: value}), f.name) == value
