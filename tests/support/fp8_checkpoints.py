"""Block-FP8 test checkpoints and their HF reference, written independently of model/fp8.py (so a shared mistake
cannot hide): the quantization follows HF's FineGrainedFP8 quantizer (scale = 448 / block amax, weight * scale
rounded to e4m3, ``weight_scale_inv`` = 1 / scale) and DeepSeek-V3 / vLLM's per-token-group activations (scale =
group amax / 448)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's way, for weights whose sides are multiples of the block."""
    n, k = w.shape
    bn, bk = block
    assert n % bn == 0 and k % bk == 0, (w.shape, block)
    tiles = w.float().reshape(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3)
    scale = E4M3_MAX / tiles.abs().amax(dim=(-1, -2))
    q = (tiles * scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.permute(0, 2, 1, 3).reshape(n, k)
    return q, scale.reciprocal()


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    bn, bk = block
    tiles = q.float().reshape(n // bn, bn, k // bk, bk) * scale_inv[:, None, :, None]
    return tiles.reshape(n, k)


def write_block_fp8(
    src: Path, dst: Path, block: tuple[int, int] = (128, 128), keep: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """From a float32 checkpoint: ``dst/fp8`` (e4m3 weights + ``weight_scale_inv`` + the quantization_config;
    the projections named in ``keep`` stay float32, listed in ``modules_to_not_convert``) and ``dst/dequantized``
    (float32, the e4m3 weights times their scales: the reference's weights)."""
    fp8_dir, ref_dir = dst / "fp8", dst / "dequantized"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED and name.split(".")[-2] not in keep:
            q, s = block_quantize(t, block)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            dequantized[name] = block_dequantize(q, s, block)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, ref_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", *keep],
    }
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, ref_dir


def fake_quantize_input(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """An activation as an FP8 GEMM sees it: e4m3 with one scale per token (``group`` None) or per token and group."""
    shape = x.shape
    x = x.float().reshape(-1, shape[-1] if group is None else group)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(shape)


# our packed layers -> the checkpoint's (HF's) projections that take the same input
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def by_hf_name(engine_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs of our linear layers (by our module names) keyed by the HF projections that take them."""
    out = {}
    for name, x in engine_inputs.items():
        prefix, last = name.rsplit(".", 1)
        for hf_name in PACKED.get(last, (last,)):
            out[f"{prefix}.{hf_name}"] = x
    return out


def hf_logits(
    model_dir: Path,
    prompts: list[list[int]],
    act_group: int | None | str = "none",
    keep: tuple[str, ...] = (),
    engine_inputs: dict[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """HF transformers' float32 logits; with ``act_group`` an int or None, the inputs of the quantized projections
    (all but ``keep``) are fake-quantized first (per token group / per token), as an FP8 GEMM quantizes them.

    ``engine_inputs`` (our layers' inputs in the same forward, the prompts' tokens concatenated): a token whose HF
    input is within float32 noise (1e-5 relative) of ours is quantized from ours, so that both round the same values.
    Otherwise the two roundings part wherever float32 noise straddles an e4m3 rounding boundary (about once per
    forward of these test models) and attention carries the difference to every later token. A real difference
    (a wrong weight, scale or activation) exceeds the noise at the first layer it touches, and from there on HF
    quantizes its own inputs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = by_hf_name(engine_inputs or {})
    offset = [0]

    def quantize(name: str, x: torch.Tensor) -> torch.Tensor:
        mine = ours.get(name)
        if mine is not None:
            mine = mine[offset[0] : offset[0] + x.shape[1]].to(x.dtype)[None]
            close = (x - mine).norm(dim=-1, keepdim=True) <= 1e-5 * mine.norm(dim=-1, keepdim=True)
            x = torch.where(close, mine, x)
        return fake_quantize_input(x, act_group)

    if act_group != "none":
        for name, module in hf.named_modules():
            if name.split(".")[-1] in QUANTIZED and name.split(".")[-1] not in keep:
                module.register_forward_pre_hook(lambda m, args, name=name: (quantize(name, args[0]),))
    logits = []
    with torch.no_grad():
        for p in prompts:
            logits.append(hf(torch.tensor([p])).logits[0].float())
            offset[0] += len(p)
    return logits


def capture_linear_inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Registers hooks that keep the input of each of our linear layers' first call (filled as the model runs)."""
    from model.linear import LinearBase

    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, args[0].detach().clone()))
    return seen


def rows_rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(g - r).norm(dim=-1) / r.norm(dim=-1) for g, r in zip(got, ref)])
