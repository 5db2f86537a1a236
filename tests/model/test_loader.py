"""model/loader.py and model/config.py: clear errors that name the problem, sharded checkpoints, both config
generations, dummy weights; and the name clash of our ``kernels`` package with the hub's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.loader import checkpoint_files, load_model
from tests.support.builders import make_step, worker_config
from tests.support.processes import ROOT
from worker.model_runner import ModelRunner

CPU = torch.device("cpu")


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    cfg_file = model_dir / "config.json"
    raw = json.loads(cfg_file.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    cfg_file.write_text(json.dumps(raw))


def prompt_logits(model_dir: Path, load_format: str = "auto") -> torch.Tensor:
    r = ModelRunner(worker_config(model_dir, load_format=load_format), CPU)
    r.allocate_kv(8)
    ids = np.random.default_rng(0).integers(0, 500, 20).tolist()
    return r.forward_logits(make_step([dict(slot=0, tokens=ids, start=0, new_blocks=[0, 1])]))


@pytest.fixture(scope="module")
def reference_logits(tiny_tied) -> torch.Tensor:
    return prompt_logits(tiny_tied)


# ---- clear errors --------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        load_model(missing, CPU, torch.float32)
    assert str(missing) in str(e.value)


def test_directory_without_config(tmp_path, tiny_tied):
    shutil.copy(tiny_tied / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        load_model(tmp_path, CPU, torch.float32)
    assert str(tmp_path) in str(e.value)


def test_unsupported_architecture(tmp_path, tiny_tied):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    edit_config(d, architectures=["GemmaForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'GemmaForCausalLM'"):
        load_model(d, CPU, torch.float32)


def test_unsupported_rope_scaling_is_refused(tmp_path, tiny_tied):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    edit_config(d, rope_parameters={"rope_theta": 1e6, "rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        ModelConfig.from_pretrained(d)
    # 4.x spelling, including the older "type" key (Qwen2.5-style configs)
    for scaling in ({"rope_type": "longrope", "factor": 2.0}, {"type": "dynamic", "factor": 4.0}):
        edit_config(d, rope_parameters=None, rope_theta=1e6, rope_scaling=scaling)
        with pytest.raises(ValueError, match=f"rope_type '{scaling.get('type', 'longrope')}' is not supported"):
            ModelConfig.from_pretrained(d)


def write_without(model_dir: Path, drop: str) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    assert drop in tensors
    del tensors[drop]
    save_file(tensors, model_dir / "model.safetensors")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.up_proj.weight",  # half of a packed gate_up parameter
        "model.layers.1.self_attn.k_proj.weight",  # a third of a packed qkv parameter
        "model.layers.0.input_layernorm.weight",  # a plain parameter
        "model.embed_tokens.weight",
    ],
)
def test_missing_tensor_is_named(tmp_path, tiny_tied, name):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    write_without(d, name)
    with pytest.raises(ValueError, match="missing tensors") as e:
        load_model(d, CPU, torch.float32)
    assert str(d) in str(e.value)
    assert str(e.value).split("missing tensors: ")[1] == name  # that one, in the checkpoint's own name


def test_missing_lm_head_of_untied_model(tmp_path, tiny_untied):
    d = copy_checkpoint(tiny_untied, tmp_path / "m")
    write_without(d, "lm_head.weight")
    with pytest.raises(ValueError, match="missing tensors: lm_head.weight"):
        load_model(d, CPU, torch.float32)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 63)),
        ("model.layers.1.self_attn.k_proj.weight", (48, 64)),
        ("model.layers.0.self_attn.q_proj.weight", (64, 32)),
        ("model.layers.0.mlp.gate_proj.weight", (127, 64)),
        ("model.layers.0.self_attn.q_norm.weight", (17,)),
        ("model.embed_tokens.weight", (511, 64)),
    ],
)
def test_shape_mismatch_names_tensor_and_file(tmp_path, tiny_tied, name, shape):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors[name] = torch.zeros(shape)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="shape mismatch") as e:
        load_model(d, CPU, torch.float32)
    assert repr(name) in str(e.value)
    assert "model.safetensors" in str(e.value)
    assert str(tuple(shape)) in str(e.value) or f"has {shape[0]} rows" in str(e.value)  # the bad shape


# ---- sharded checkpoints -------------------------------------------------------------------------------


def shard(model_dir: Path) -> list[str]:
    """Split model.safetensors into two files with an index, like save_pretrained(max_shard_size=...)."""
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[::2], names[1::2]]  # interleaved: every layer is spread over both files
    weight_map = {}
    for fname, part in zip(files, halves):
        save_file({k: tensors[k] for k in part}, model_dir / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in tensors.values())}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return files


def test_sharded_checkpoint_gives_same_logits(tmp_path, tiny_tied, reference_logits):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    files = shard(d)
    assert [f.name for f in checkpoint_files(d)] == files
    got = prompt_logits(d)
    assert torch.equal(got, reference_logits)
    single = dict(load_model(tiny_tied, CPU, torch.float32).named_parameters())
    for name, p in load_model(d, CPU, torch.float32).named_parameters():
        assert torch.equal(p, single[name]), name


def test_file_listed_in_index_but_missing(tmp_path, tiny_tied):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    files = shard(d)
    (d / files[1]).unlink()
    with pytest.raises(FileNotFoundError, match="listed in model.safetensors.index.json but missing") as e:
        load_model(d, CPU, torch.float32)
    assert files[1] in str(e.value)


def test_no_safetensors_files(tmp_path, tiny_tied):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_model(d, CPU, torch.float32)


# ---- config generations --------------------------------------------------------------------------------


def test_config_transformers_4x_style(tmp_path, tiny_tied, reference_logits):
    """rope_theta and torch_dtype at the top level; same model, same logits."""
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    edit_config(d, rope_parameters=None, dtype=None, rope_theta=1_000_000.0, torch_dtype="float32")
    raw = json.loads((d / "config.json").read_text())
    assert "rope_parameters" not in raw and "dtype" not in raw
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.dtype == torch.float32
    assert torch.equal(prompt_logits(d), reference_logits)
    # a different theta really is read (and changes the model)
    edit_config(d, rope_theta=10_000.0, torch_dtype="bfloat16")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.rope_theta == 10_000.0 and cfg.dtype == torch.bfloat16
    assert not torch.allclose(prompt_logits(d), reference_logits)


def test_config_transformers_5x_style(tmp_path, tiny_tied):
    d = copy_checkpoint(tiny_tied, tmp_path / "m")
    edit_config(d, rope_theta=None, torch_dtype=None, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    edit_config(d, dtype="bfloat16")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.rope_theta == 5e5 and cfg.dtype == torch.bfloat16
    # 5.x wins when a config carries both
    edit_config(d, rope_theta=123.0, torch_dtype="float16")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.rope_theta == 5e5 and cfg.dtype == torch.bfloat16


def test_config_fields(tiny_untied):
    cfg = ModelConfig.from_pretrained(tiny_untied)
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (509, 3, 2, 16)
    assert cfg.tie_word_embeddings is False
    assert cfg.eos_token_id == (0,)


# ---- dummy weights -------------------------------------------------------------------------------------


def test_dummy_load_format_needs_only_config(tmp_path, tiny_tied):
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(tiny_tied / "config.json", d / "config.json")
    with pytest.raises(FileNotFoundError):
        load_model(d, CPU, torch.float32)  # auto needs weights
    model = load_model(d, CPU, torch.float32, load_format="dummy", seed=3)
    params = dict(model.named_parameters())
    assert params["model.embed_tokens.weight"].shape == (512, 64)
    assert torch.all(params["model.norm.weight"] == 1.0)
    assert 0.01 < float(params["model.layers.0.mlp.down_proj.weight"].std()) < 0.04
    # deterministic per seed
    again = dict(load_model(d, CPU, torch.float32, load_format="dummy", seed=3).named_parameters())
    assert torch.equal(
        again["model.layers.1.self_attn.qkv_proj.weight"], params["model.layers.1.self_attn.qkv_proj.weight"]
    )
    # and it runs
    logits = prompt_logits(d, load_format="dummy")
    assert logits.shape == (20, 512) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="load_format"):
        load_model(d, CPU, torch.float32, load_format="pt")


# ---- the kernels name clash ----------------------------------------------------------------------------


def test_transformers_does_not_mistake_our_kernels_package_for_the_hub_one():
    """Our top-level ``kernels`` package shadows the hub ``kernels`` package's import name; transformers
    must not conclude the hub package is installed (it would try to use it)."""
    code = (
        "import importlib.util, kernels, sys\n"
        "from pathlib import Path\n"
        "assert Path(kernels.__file__).resolve().parent.parent == Path.cwd().resolve(), kernels.__file__\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print('available', is_kernels_available())\n"
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "available False" in out.stdout
