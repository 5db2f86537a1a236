"""The engine with FP8 weights, an FP8 KV cache and both, against the bf16 engine on the same dummy weights of real
shapes, with the float32 emulation of the same quantization (model/fp8.py) in the same engine as the oracle for
the FP8 kernels (CUDA only, ``gpu``)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from model import fp8
from tests.support.builders import make_step, worker_config
from tests.support.oracle import rel_err

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def engine_logits(model_dir, steps: int = 0, **kw) -> tuple[torch.Tensor, list[int]]:
    """Teacher-forced logits of two prompts, then ``steps`` greedy decode steps of the first (its tokens)."""
    from worker.model_runner import ModelRunner

    cfg = worker_config(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend="triton",
        max_model_len=2048,
        num_kv_blocks=256,
        **kw,
    )
    r = ModelRunner(cfg, DEVICE)
    r.allocate_kv(256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, n).tolist() for n in (300, 40)]
    seqs = [dict(slot=i, tokens=t, start=0, new_blocks=list(range(32 * i, 32 * i + 32))) for i, t in enumerate(prompts)]
    logits = r.forward_logits(make_step(seqs)).float()
    tokens = [int(logits[len(prompts[0]) - 1].argmax())]
    for s in range(steps):
        step = make_step([dict(slot=0, tokens=[tokens[-1]])], step_id=s + 1)
        tokens.append(int(r.forward_logits(step)[0].argmax()))
    del r
    torch.cuda.empty_cache()
    return logits, tokens


def emulated_apply(self, layer, x, out=None):
    """Fp8LinearMethod.apply through model/fp8.py's float32 emulation, on the GPU: the same quantization as the
    kernels, without their rounding of the sums."""
    y = fp8.emulated_linear(x.reshape(-1, x.shape[-1]).float(), layer.weight, self.scale(layer), self.cfg, layer.bias)
    y = y.to(x.dtype) if out is None else out.copy_(y)
    return y.view(*x.shape[:-1], y.shape[-1])


def dummy_shape(shape: str, layers: int | None, tmp_path) -> str:
    """A real shape's config dir, cut to ``layers`` decoder layers (a random-weight stack this shallow is not yet
    chaotic: there the error of one quantization shows rather than its amplification)."""
    from benchmarks.shapes import write_shape

    model_dir = write_shape(shape)
    if layers is None:
        return model_dir
    cut = shutil.copytree(model_dir, tmp_path / f"{shape}-{layers}", dirs_exist_ok=True)
    cfg = json.loads((cut / "config.json").read_text())
    (cut / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    return cut


@gpu
@needs_cuda
@pytest.mark.parametrize("shape,layers", [("qwen3-0.6b", None), ("qwen3-8b", 2), ("qwen3-8b", None)])
def test_fp8_engine_logits_on_dummy_weights(shape, layers, tmp_path, monkeypatch):
    """FP8 weights, FP8 KV and both against the bf16 engine on the same dummy weights (seed 0): relative logit error
    and the fraction of positions and greedy decode steps whose top token agrees, printed for the record.

    The oracle for the FP8 kernels is the float32 emulation of the same quantization run in the same engine: the
    kernels' logits must be no further from bf16's than the emulation's. A deep random-weight stack amplifies any
    perturbation (Qwen3-8B's 36 layers turn ~15% after two layers into ~50%, the emulation's as much as ours),
    so the absolute bounds hold for the 0.6B model and the two-layer 8B cut only."""
    from model.fp8_linear import Fp8LinearMethod

    model_dir = dummy_shape(shape, layers, tmp_path)
    ref, ref_tokens = engine_logits(model_dir, steps=32)
    record = {"shape": shape, "layers": layers or "all"}
    variants = {
        "fp8_weights": dict(quantization="fp8"),
        "fp8_kv": dict(kv_cache_dtype="fp8"),
        "fp8_both": dict(quantization="fp8", kv_cache_dtype="fp8"),
    }
    for name, kw in variants.items():
        logits, tokens = engine_logits(model_dir, steps=32, **kw)
        record[name] = {
            "rel_err": round(rel_err(logits, ref), 5),
            "argmax_agree": round((logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            "greedy_steps_agree": round(float(np.mean([a == b for a, b in zip(tokens, ref_tokens)])), 4),
        }
    with monkeypatch.context() as m:
        m.setattr(Fp8LinearMethod, "apply", emulated_apply)
        emulated, _ = engine_logits(model_dir, **variants["fp8_weights"])
    record["fp8_weights_emulated_rel_err"] = round(rel_err(emulated, ref), 5)
    print(json.dumps(record))
    assert record["fp8_weights"]["rel_err"] < 1.15 * record["fp8_weights_emulated_rel_err"] + 0.01, record
    if shape == "qwen3-0.6b" or layers is not None:
        assert record["fp8_weights"]["rel_err"] < 0.25, record
        assert record["fp8_kv"]["rel_err"] < 0.1, record
        assert record["fp8_both"]["rel_err"] < 0.3, record
        assert record["fp8_both"]["argmax_agree"] > 0.5, record


def decode_logits(model_dir, **kw) -> list[torch.Tensor]:
    """Teacher-forced logits of two prompts (137 rows in one step), then of 4 steps decoding both (2 rows): every
    step within the row counts model/fp8_folded.py takes."""
    from worker.model_runner import ModelRunner

    cfg = worker_config(
        model_dir, device="cuda", dtype="bfloat16", load_format="dummy", attention_backend="triton", **kw
    )
    r = ModelRunner(cfg, DEVICE)
    r.allocate_kv(64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 10000, n).tolist() for n in (100, 37)]
    seqs = [dict(slot=i, tokens=t, start=0, new_blocks=list(range(16 * i, 16 * i + 16))) for i, t in enumerate(prompts)]
    out = [r.forward_logits(make_step(seqs)).float()]
    last = [int(out[0][99].argmax()), int(out[0][136].argmax())]
    for s in range(4):
        out.append(r.forward_logits(make_step([dict(slot=i, tokens=[t]) for i, t in enumerate(last)], step_id=s + 1)))
        last = out[-1].argmax(-1).tolist()
    del r
    torch.cuda.empty_cache()
    return out


@gpu
@needs_cuda
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("shape", ["qwen3-8b", "llama3.1-8b"])  # llama: RoPE without q/k norms
def test_folded_scales_give_the_same_logits(shape, kv, tmp_path, monkeypatch):
    """model/fp8_folded.py (each FP8 product's scales applied by the kernel reading it) against the layers' own
    forward (a rescale launch after each product): the same bits, at 137 and at 2 rows."""
    from model import fp8_folded

    model_dir = dummy_shape(shape, 2, tmp_path)
    taken, layer_forward = [], fp8_folded.layer_forward
    monkeypatch.setattr(fp8_folded, "layer_forward", lambda *a: taken.append(a[2]) or layer_forward(*a))
    folded = decode_logits(model_dir, quantization="fp8", kv_cache_dtype=kv)
    assert len(taken) == 2 * 5  # two layers, five steps
    monkeypatch.setattr(fp8_folded, "_takes_model", lambda layers: False)  # the path TP > 1 and MoE models take
    unfolded = decode_logits(model_dir, quantization="fp8", kv_cache_dtype=kv)
    assert len(taken) == 10
    for a, b in zip(folded, unfolded, strict=True):
        assert torch.equal(a, b)
