"""FP8 weights on the CPU: block-FP8 checkpoints (written here from float32 ones) load at TP 1 and 2 and compute
what HF computes on the same dequantized weights with FP8-quantized activations; shards that split a scale block
and bad scale shapes are refused naming the tensor; online quantization's scales and round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from comm.parallel import set_tp
from model import fp8
from model.fp8_linear import Fp8LinearMethod
from model.linear import LinearBase
from model.loader import load_model
from model.tiny import TinySpec, write_tiny_checkpoint
from tests.support.builders import make_step, worker_config
from tests.support.fp8_checkpoints import (
    block_quantize,
    capture_linear_inputs,
    hf_logits,
    rows_rel_err,
    write_block_fp8,
)
from tests.support.processes import ROOT, torchrun_cmd
from worker.model_runner import ModelRunner

CPU = torch.device("cpu")
# every quantized dimension a multiple of 128, and still at TP 2: q/k/v/o 256 (2 heads of 128), gate/up/down 512
FP8_SPEC = TinySpec(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=128,
    tie_word_embeddings=False,
    seed=5,
    std=0.1,
)


@pytest.fixture(scope="module")
def block_fp8(tmp_path_factory) -> tuple[Path, Path]:
    """(block-FP8 checkpoint, float32 checkpoint of its dequantized weights)."""
    base = tmp_path_factory.mktemp("fp8")
    src = write_tiny_checkpoint(base / "f32", FP8_SPEC)
    return write_block_fp8(src, base)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 500, n).tolist() for n in (37, 6)]


def engine_logits(model_dir: Path, inputs: dict | None = None, **kw) -> list[torch.Tensor]:
    """Teacher-forced logits of ``prompts()``; ``inputs``: filled with our linear layers' inputs."""
    r = ModelRunner(worker_config(model_dir, **kw), CPU)
    r.allocate_kv(16)
    capture = capture_linear_inputs(r.model) if inputs is not None else {}
    ps = prompts()
    seqs = [dict(slot=i, tokens=p, start=0, new_blocks=[4 * i, 4 * i + 1, 4 * i + 2]) for i, p in enumerate(ps)]
    logits = r.forward_logits(make_step(seqs))
    if inputs is not None:
        inputs.update(capture)
    return list(logits.split([len(p) for p in ps]))


def assert_matches(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    err = rows_rel_err(got, ref)
    assert err.max() < 1e-4, err.max()


# ---- block-FP8 checkpoints ----------------------------------------------------------------------------------


def test_block_fp8_checkpoint_matches_hf_on_dequantized_weights(block_fp8):
    fp8_dir, ref_dir = block_fp8
    model = load_model(fp8_dir, CPU, torch.float32)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (6, 2)
    assert isinstance(layer.quant, Fp8LinearMethod)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32

    inputs: dict = {}
    got = engine_logits(fp8_dir, inputs)
    assert_matches(got, hf_logits(ref_dir, prompts(), act_group=128, engine_inputs=inputs))  # 128-column groups
    # what makes the test able to fail: per-token activation scales, or none, put every row off by percents
    for other in (None, "none"):
        assert rows_rel_err(got, hf_logits(ref_dir, prompts(), act_group=other, engine_inputs=inputs)).min() > 1e-3


def test_modules_to_not_convert_stay_full_precision(tmp_path, block_fp8):
    """A checkpoint that keeps down_proj in float32 (modules_to_not_convert): only the other projections are FP8."""
    _, ref_dir = block_fp8
    src = tmp_path / "f32"
    src.mkdir()
    for f in ref_dir.iterdir():
        (src / f.name).symlink_to(f)
    fp8_dir, ref = write_block_fp8(src, tmp_path, keep=("down_proj",))
    model = load_model(fp8_dir, CPU, torch.float32)
    mlp = model.model.layers[1].mlp
    assert mlp.down_proj.quant is None and mlp.down_proj.weight.dtype == torch.float32
    assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    inputs: dict = {}
    got = engine_logits(fp8_dir, inputs)
    assert_matches(got, hf_logits(ref, prompts(), act_group=128, keep=("down_proj",), engine_inputs=inputs))
    raw = json.loads((fp8_dir / "config.json").read_text())
    raw["quantization_config"]["modules_to_not_convert"] = ["up_proj"]  # half of the packed gate_up layer
    (fp8_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="keeps only some parts of model.layers.0.mlp.gate_up_proj"):
        load_model(fp8_dir, CPU, torch.float32)


def test_block_fp8_shards_at_tp2(block_fp8):
    """Each rank holds its rows (column-parallel) or columns (row-parallel) of the e4m3 weights and the matching
    rows / columns of block scales."""
    fp8_dir, _ = block_fp8
    tensors = load_file(fp8_dir / "model.safetensors")
    pre = "model.layers.1."
    try:
        for rank in range(2):
            set_tp(rank, 2)
            layers = load_model(fp8_dir, CPU, torch.float32).model.layers[1]
            qkv, gate_up, down = layers.self_attn.qkv_proj, layers.mlp.gate_up_proj, layers.mlp.down_proj
            rows = slice(128 * rank, 128 * (rank + 1))  # one q head / kv head of 128 rows each
            want = [tensors[pre + f"self_attn.{p}_proj.weight"][rows] for p in "qkv"]
            assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(want).view(torch.uint8))
            want = [tensors[pre + f"self_attn.{p}_proj.weight_scale_inv"][rank : rank + 1] for p in "qkv"]
            assert torch.equal(qkv.weight_scale_inv, torch.cat(want))
            want = [tensors[pre + f"mlp.{p}_proj.weight_scale_inv"][2 * rank : 2 * rank + 2] for p in ("gate", "up")]
            assert torch.equal(gate_up.weight_scale_inv, torch.cat(want))
            cols = slice(256 * rank, 256 * (rank + 1))
            assert torch.equal(
                down.weight.view(torch.uint8), tensors[pre + "mlp.down_proj.weight"][:, cols].view(torch.uint8)
            )
            assert torch.equal(
                down.weight_scale_inv, tensors[pre + "mlp.down_proj.weight_scale_inv"][:, 2 * rank : 2 * rank + 2]
            )
    finally:
        set_tp(0, 1)


def test_block_fp8_logits_at_tp2_under_torchrun(block_fp8):
    fp8_dir, ref_dir = block_fp8
    module = "tests.tensor_parallel.fp8_tp_logits"
    cmd = torchrun_cmd(2, module, "--model", str(fp8_dir), "--reference", str(ref_dir))
    out = subprocess.run(cmd, env=dict(os.environ), cwd=str(ROOT), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert '"ok": true' in out.stdout


def test_block_that_straddles_a_tp_split_is_refused(tmp_path):
    # 4 heads of 64: at TP 2 each rank's k_proj / v_proj rows are one 64-row kv head, half a 128-row block
    spec = TinySpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    fp8_dir, _ = write_block_fp8(write_tiny_checkpoint(tmp_path / "f32", spec), tmp_path)
    load_model(fp8_dir, CPU, torch.float32)  # whole blocks at TP 1
    try:
        set_tp(1, 2)
        with pytest.raises(ValueError, match="split a 128x128 FP8 scale block") as e:
            load_model(fp8_dir, CPU, torch.float32)
    finally:
        set_tp(0, 1)
    msg = str(e.value)
    # the weight or its scales, whichever the file holds first (the loader reads in file order)
    assert "tensor 'model.layers.0.self_attn.k_proj.weight" in msg and "rows 64..128" in msg, msg
    assert "tensor parallel size 2" in msg


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.o_proj.weight_scale_inv", (1, 2)),
        ("model.layers.1.mlp.down_proj.weight_scale_inv", (2, 3)),
    ],
)
def test_bad_scale_shape_is_refused(tmp_path, block_fp8, name, shape):
    fp8_dir, _ = block_fp8
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((fp8_dir / "config.json").read_text())
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors[name] = torch.ones(shape)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="scale shape") as e:
        load_model(d, CPU, torch.float32)
    assert f"tensor {name!r}" in str(e.value) and f"{shape}" in str(e.value), str(e.value)
    assert "expected (2, 4)" in str(e.value) or "expected (2, 2)" in str(e.value)


def test_unsupported_quantization_configs_are_refused(tmp_path, block_fp8):
    fp8_dir, _ = block_fp8
    raw = json.loads((fp8_dir / "config.json").read_text())
    cases = [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "powers of 2"),
    ]
    for qc, message in cases:
        d = tmp_path / f"m{len(message)}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(raw, quantization_config=qc)))
        with pytest.raises(ValueError, match=message) as e:
            load_model(d, CPU, torch.float32)
        assert "config.json" in str(e.value)


def test_fp8_weights_without_quantization_config_are_refused(tmp_path, block_fp8):
    fp8_dir, _ = block_fp8
    d = tmp_path / "m"
    d.mkdir()
    raw = json.loads((fp8_dir / "config.json").read_text())
    del raw["quantization_config"]
    (d / "config.json").write_text(json.dumps(raw))
    (d / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    with pytest.raises(ValueError, match="float8 weights need an fp8 quantization_config"):
        load_model(d, CPU, torch.float32)


def test_block_fp8_checkpoint_with_dummy_weights(block_fp8):
    """load_format=dummy: random 16-bit weights quantized to the checkpoint's blocks at load."""
    fp8_dir, _ = block_fp8
    model = load_model(fp8_dir, CPU, torch.float32, load_format="dummy")
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale_inv.shape == (2, 4)
    assert engine_logits(fp8_dir, load_format="dummy")[0].isfinite().all()


# ---- online quantization ------------------------------------------------------------------------------------


def quantized_linears(model) -> dict[str, LinearBase]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


def test_online_quantization_scales_and_round_trip(tiny_untied):
    ref = quantized_linears(load_model(tiny_untied, CPU, torch.float32))
    model = load_model(tiny_untied, CPU, torch.float32, quantization="fp8")
    layers = quantized_linears(model)
    assert set(layers) == set(ref) and len(layers) == 4 * 3
    for name, layer in layers.items():
        w = ref[name].weight.data
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (w.shape[0],)
        torch.testing.assert_close(layer.weight_scale, w.abs().amax(dim=1) / 448.0, rtol=0, atol=0)
        q = layer.weight.float()
        assert torch.equal(q.abs().amax(dim=1), torch.full((w.shape[0],), 448.0))  # each row's max maps to 448
        back = q * layer.weight_scale[:, None]
        # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a normal value; below 2^-6 steps of 2^-9 (times scale)
        bound = torch.maximum(w.abs() / 16, layer.weight_scale[:, None] * 2.0**-10)
        assert ((back - w).abs() <= bound * 1.0001).all(), name
    assert model.lm_head.weight.dtype == torch.float32


def test_online_quantization_logits(tmp_path, tiny_untied):
    """The engine's logits with quantization="fp8" equal HF on the engine's own dequantized weights with activations
    quantized per token."""
    model = load_model(tiny_untied, CPU, torch.float32, quantization="fp8")
    tensors = load_file(tiny_untied / "model.safetensors")
    for name, layer in quantized_linears(model).items():
        w = fp8.dequantize(layer.weight, layer.weight_scale, None)
        if name.endswith("qkv_proj"):
            q, k, v = w.split([64, 32, 32])
            parts = {"q_proj": q, "k_proj": k, "v_proj": v}
        elif name.endswith("gate_up_proj"):
            parts = dict(zip(("gate_proj", "up_proj"), w.chunk(2)))
        else:
            parts = {name.split(".")[-1]: w}
        prefix = name.rsplit(".", 1)[0]
        for part, t in parts.items():
            tensors[f"{prefix}.{part}.weight"] = t.contiguous()
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    for f in tiny_untied.iterdir():
        if f.name != "model.safetensors":
            (ref_dir / f.name).symlink_to(f)
    save_file(tensors, ref_dir / "model.safetensors", metadata={"format": "pt"})
    inputs: dict = {}
    got = engine_logits(tiny_untied, inputs, quantization="fp8")
    assert_matches(got, hf_logits(ref_dir, prompts(), act_group=None, engine_inputs=inputs))
    # and near the unquantized model (std-0.2 random weights amplify the rounding: 18% measured)
    plain = hf_logits(tiny_untied, prompts())
    assert max(((g - r).norm() / r.norm()).item() for g, r in zip(got, plain)) < 0.3


def test_online_quantization_of_dummy_weights(tiny_tied):
    model = load_model(tiny_tied, CPU, torch.float32, load_format="dummy", quantization="fp8")
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in quantized_linears(model).values())
    assert engine_logits(tiny_tied, load_format="dummy", quantization="fp8")[0].isfinite().all()


def test_quantization_argument_is_checked(tiny_tied):
    with pytest.raises(ValueError, match="quantization: unsupported value 'int4'"):
        load_model(tiny_tied, CPU, torch.float32, quantization="int4")


def test_reference_quantizer_agrees_with_ours():
    """The tests' HF-style block quantizer and model/fp8.py's give the same e4m3 weights and scales (up to the
    rounding of 1 / (448 / amax) against amax / 448)."""
    w = torch.randn(256, 384) * 0.05
    q_ref, s_ref = block_quantize(w, (128, 128))
    q, s = fp8.quantize_blocks(w, (128, 128))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
