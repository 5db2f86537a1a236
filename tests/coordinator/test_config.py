"""coordinator/config.py: a bad engine argument is refused by name before any worker process starts."""

from __future__ import annotations

import pytest

import coordinator.engine
from coordinator.config import EngineArgError, EngineConfig
from model.config import ModelConfig
from nanoserve import LLM


@pytest.mark.parametrize(
    "kwargs, name, message",
    [
        (dict(dtype="float33"), "dtype", "dtype must be one of auto, bfloat16, .*got 'float33'"),
        (dict(attention_backend="cudnn"), "attention_backend", "attention_backend must be one of auto, torch, triton"),
        (dict(device="tpu"), "device", "device must be cpu or cuda, got 'tpu'"),
        (dict(load_format="pt"), "load_format", "load_format must be auto or dummy"),
        (dict(external_workers=True), "worker_address", "worker_address is required with external_workers"),
        (dict(worker_timeout_s=0), "worker_timeout_s", "worker_timeout_s must be > 0"),
        (dict(chat_template="no/such.jinja"), "chat_template", "'no/such.jinja' is neither a file nor a Jinja"),
        (dict(tokenizer="no/such/dir"), "tokenizer", "tokenizer: no directory 'no/such/dir'"),
        (dict(generation_config="none"), "generation_config", "generation_config must be auto, vllm or a directory"),
        # the model's limit is 2048: refused as vLLM refuses it, not silently lowered
        (
            dict(device="cpu", max_model_len=100000),
            "max_model_len",
            r"max_model_len=100000 is longer than the model's limit: max_position_embeddings=2048",
        ),
        (
            dict(device="cpu", tensor_parallel_size=3),
            "tensor_parallel_size",
            r"num_attention_heads=4 is not divisible by tensor_parallel_size=3",
        ),
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


def test_max_model_len_is_resolved_in_the_config_itself(tiny_tied):
    """The engine enforces cfg.max_model_len: 0 becomes the model's limit there, any value up to it stays."""
    model = ModelConfig.from_pretrained(tiny_tied)
    for asked, enforced in ((0, 2048), (2048, 2048), (300, 300)):
        cfg = EngineConfig(device="cpu", max_model_len=asked)
        cfg.fit_model(model)
        assert cfg.max_model_len == enforced


def _model(heads: int, kv_heads: int, intermediate: int, **moe) -> ModelConfig:
    raw = dict(
        architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        vocab_size=509,  # never needs to divide: the vocabulary is padded to a multiple of tp
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
    )
    return ModelConfig.from_dict({**raw, **moe})


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=36)


@pytest.mark.parametrize(
    "model, tp, message",
    [
        (_model(8, 2, 128), 8, None),  # 2 kv heads on 8 ranks: each replicated on 4
        (_model(8, 8, 128), 4, None),
        (_model(8, 8, 128), 1, None),
        (_model(8, 4, 100), 8, "the model's intermediate_size=100 is not divisible by tensor_parallel_size=8"),
        (_model(12, 4, 96), 6, "num_key_value_heads=4 and tensor_parallel_size=6 do not divide one another"),
        (_model(8, 4, 100, **MOE), 4, None),  # every layer has experts: intermediate_size is unused
        (_model(8, 4, 96, **MOE), 8, "the model's moe_intermediate_size=36 is not divisible by tensor_parallel_size=8"),
        (_model(8, 4, 100, **MOE, mlp_only_layers=[0]), 8, "the model's intermediate_size=100 is not divisible"),
    ],
)
def test_tensor_parallel_size_must_split_what_tp_shards(model, tp, message):
    cfg = EngineConfig(device="cpu", tensor_parallel_size=tp)
    if message is None:
        cfg.fit_model(model)
        return
    with pytest.raises(EngineArgError, match=message) as e:
        cfg.fit_model(model)
    assert e.value.name == "tensor_parallel_size"
