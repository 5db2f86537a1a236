"""FP8 linear layers: a model's ``LinearBase`` layers with e4m3 weights and float32 scales, and their forward.

A block-FP8 checkpoint is loaded straight into e4m3 parameters (``prepare_checkpoint_params`` before loading): each
layer gets ``weight`` (e4m3) and ``weight_scale_inv`` (one scale per block), whose loaders cut this rank's shard
from the layer's own ``shard`` description, in elements for the weight and in blocks for the scales, and refuse a
shard that does not hold whole blocks. Online quantization (``quantize_loaded``) replaces a loaded 16-bit weight
by e4m3 and ``weight_scale`` (one scale per output channel), or by blocks when a block-FP8 checkpoint is run with
dummy weights. The embedding, the norms and the LM head are not ``LinearBase`` layers and stay in 16 bits.

Forward: kernels/fp8_gemm.py on CUDA; on the CPU the same quantization arithmetic in float32 (model/fp8.py).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from comm.parallel import tp_size
from kernels import fp8_gemv, fp8_mlp, fused
from kernels.fp8_gemm import GEMV_ROWS, fp8_linear, quantized_linear
from kernels.scaled_mm import uses_scaled_mm
from model.fp8 import FP8, Fp8Config, emulated_linear, quantize_blocks, quantize_per_channel
from model.linear import LinearBase, Shard


class Fp8LinearMethod:
    """The forward of a quantized ``LinearBase`` (its ``quant``)."""

    def __init__(self, cfg: Fp8Config) -> None:
        self.cfg = cfg

    def scale(self, layer: LinearBase) -> torch.Tensor:
        return layer.weight_scale if self.cfg.block is None else layer.weight_scale_inv

    def apply(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x.is_cuda:
            y = fp8_linear(x2, layer.weight, self.scale(layer), self.cfg.block, layer.bias, out)
        else:
            y = emulated_linear(x2, layer.weight, self.scale(layer), self.cfg, layer.bias)
            if out is not None:
                y = out.copy_(y)
        return y.view(*lead, y.shape[-1])

    def _quantizable_rows(self, x: torch.Tensor) -> bool:
        """16-bit rows on CUDA under per-channel scales: what a kernel in front may quantize per token."""
        return self.cfg.block is None and x.is_cuda and x.dim() == 2 and x.dtype != torch.float32

    def quantizes_row_before(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether the kernel in front of ``layer`` quantizes its input row for the GEMV (one 16-bit row, CUDA,
        per-channel scales): the GEMV's programs then read e4m3 and a scale, not each the row's amax and scaling."""
        return (
            self._quantizable_rows(x)
            and 0 < x.shape[0] <= GEMV_ROWS
            and fp8_gemv.supports(x.shape[0], layer.weight.shape[1], None)
        )

    def norm_quantizes_rows(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether the RMSNorm in front of ``layer`` quantizes 2+ 16-bit rows for its cuBLASLt product (CUDA,
        per-channel scales): one pass over the rows instead of the norm's and the quantization's."""
        return (
            self._quantizable_rows(x)
            and x.shape[0] > GEMV_ROWS
            and uses_scaled_mm(layer.weight.shape[0], layer.weight.shape[1], None, x.device)
        )

    def apply_add_norm(
        self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``apply`` of norm(x + residual), x + residual) with the norm's kernel quantizing the rows, or None where
        neither the GEMV nor cuBLASLt takes rows quantized before (``quantizes_row_before``,
        ``norm_quantizes_rows``)."""
        gemv = self.quantizes_row_before(layer, x)
        if not (gemv or self.norm_quantizes_rows(layer, x)):
            return None
        x_q, x_s, summed = fused.rmsnorm_quantized(x, norm.weight, norm.eps, residual)
        out = torch.empty((x.shape[0], layer.weight.shape[0]), dtype=x.dtype, device=x.device)
        if gemv:
            return fp8_gemv.fp8_gemv(x_q, layer.weight, self.scale(layer), None, layer.bias, out, x_scales=x_s), summed
        return quantized_linear(x_q, x_s.view(-1, 1), layer.weight, self.scale(layer), layer.bias, out), summed

    def norm_gated_mlp(
        self, gate_up: LinearBase, down: LinearBase, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``gated_mlp`` of norm(x + residual), x + residual) with the norm's kernel quantizing the rows for the
        gate/up product; None where ``norm_quantizes_rows`` or the fused MLP does not apply."""
        if not (self.norm_quantizes_rows(gate_up, x) and self.gated_mlp_applies(gate_up, down, x)):
            return None
        x_q, x_s, summed = fused.rmsnorm_quantized(x, norm.weight, norm.eps, residual)
        gu = (gate_up.weight, gate_up.weight_scale, gate_up.bias)
        dn = (down.weight, down.weight_scale, down.bias)
        return down.finish(fp8_mlp.fp8_gated_mlp(x_q, gu, dn, down.output_buffer(x), x_s, x.dtype)), summed

    def apply_silu_mul(self, layer: LinearBase, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``layer`` (a row-parallel down projection) of silu(gate) * up, with the SiLU kernel quantizing the row;
        None where the row is not quantized before the GEMV."""
        if not self.quantizes_row_before(layer, gate_up):
            return None
        x_q, x_s = fp8_mlp.silu_mul_quant(gate_up)
        out = layer.output_buffer(gate_up)
        if out is None:
            out = torch.empty((x_q.shape[0], layer.weight.shape[0]), dtype=gate_up.dtype, device=gate_up.device)
        y = fp8_gemv.fp8_gemv(x_q, layer.weight, self.scale(layer), None, layer.bias, out, x_scales=x_s)
        return layer.finish(y)

    def gated_mlp_applies(self, gate_up: LinearBase, down: LinearBase, x: torch.Tensor) -> bool:
        """Whether ``gated_mlp`` takes these rows: CUDA, per-channel scales, 2+ rows (kernels/fp8_mlp.py)."""
        if not x.is_cuda or x.dim() != 2 or self.cfg.block is not None or down.quant is None:
            return False
        return fp8_mlp.applies(x.shape[0], gate_up.weight, down.weight)

    def gated_mlp(self, gate_up: LinearBase, down: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        """``down(silu(gate(x)) * up(x))`` with the gate/up scales, SiLU-and-mul and the down input's quantization in
        one kernel (kernels/fp8_mlp.py), where that path applies (CUDA, per-channel scales, 2+ rows); else None."""
        if not self.gated_mlp_applies(gate_up, down, x):
            return None
        gu = (gate_up.weight, gate_up.weight_scale, gate_up.bias)
        y = fp8_mlp.fp8_gated_mlp(x, gu, (down.weight, down.weight_scale, down.bias), down.output_buffer(x))
        return down.finish(y)


def _param(data: torch.Tensor, loader=None) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        p.weight_loader = loader
    return p


def quantized_layers(model: nn.Module, cfg: Fp8Config) -> list[tuple[str, LinearBase]]:
    """The layers to quantize: every ``LinearBase`` but those the config keeps in 16 bits (matched on the
    checkpoint's module names, so a packed layer is kept only if all its parts are) and those that ask to be
    (``keep_full_precision``, e.g. a MoE router)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or getattr(module, "keep_full_precision", False):
            continue
        parts = [name.replace(dst, src) for src, (dst, _) in mapping.items() if name.endswith("." + dst)] or [name]
        kept = [any(frag in part for frag in cfg.ignored) for part in parts]
        if any(kept) and not all(kept):
            raise ValueError(f"quantization_config keeps only some parts of {name} in 16 bits ({parts}): unsupported")
        if not any(kept):
            layers.append((name, module))
    return layers


# ---- block-FP8 checkpoints ----------------------------------------------------------------------------------


def _block_shard(layer: LinearBase, shard_id: object, block: tuple[int, int]) -> tuple[Shard, int]:
    """The layer's shard of checkpoint tensor ``shard_id``, checked to cover whole blocks; and the block edge
    along its dim. The last block of a dimension may be partial (it ends where the tensor ends)."""
    s = layer.shard(shard_id)
    b = block[s.dim]
    whole = s.start % b == 0 and s.offset % b == 0 and (s.size % b == 0 or s.start + s.size == s.full[s.dim])
    if not whole:
        what = "rows" if s.dim == 0 else "columns"
        raise ValueError(
            f"this rank's {what} {s.start}..{s.start + s.size} (of {s.full[s.dim]}) split a {block[0]}x{block[1]} "
            f"FP8 scale block: tensor parallel size {tp_size()} must keep whole blocks per rank"
        )
    return s, b


def _load_fp8_weight(layer: LinearBase, block: tuple[int, int], param, loaded, shard_id=None) -> None:
    if loaded.dtype != FP8:
        raise ValueError(f"expected a {FP8} weight (the config says fp8), got {loaded.dtype}")
    _block_shard(layer, shard_id, block)
    layer.weight_loader(param, loaded, shard_id)


def _load_block_scales(layer: LinearBase, block: tuple[int, int], param, loaded, shard_id=None) -> None:
    s, b = _block_shard(layer, shard_id, block)
    want = (-(-s.full[0] // block[0]), -(-s.full[1] // block[1]))
    if tuple(loaded.shape) != want:
        raise ValueError(
            f"scale shape {tuple(loaded.shape)} does not fit a {s.full[0]}x{s.full[1]} weight in {block[0]}x{block[1]}"
            f" blocks: expected {want}"
        )
    size = -(-s.size // b)
    dst = param.data.narrow(s.dim, s.offset // b, size)
    dst.copy_(loaded.narrow(s.dim, s.start // b, size))


def prepare_checkpoint_params(model: nn.Module, cfg: Fp8Config) -> None:
    """Give the quantized layers e4m3 weights and block scales to load a block-FP8 checkpoint into."""
    assert cfg.block is not None
    for _, layer in quantized_layers(model, cfg):
        rows, cols = layer.weight.shape
        device = layer.weight.device
        layer.weight = _param(
            torch.empty(rows, cols, dtype=FP8, device=device), partial(_load_fp8_weight, layer, cfg.block)
        )
        blocks = (-(-rows // cfg.block[0]), -(-cols // cfg.block[1]))
        scales = torch.empty(blocks, dtype=torch.float32, device=device)
        layer.weight_scale_inv = _param(scales, partial(_load_block_scales, layer, cfg.block))
        layer.quant = Fp8LinearMethod(cfg)
    _prepare_kernels(model)


# ---- online quantization ------------------------------------------------------------------------------------


def quantize_loaded(model: nn.Module, cfg: Fp8Config) -> None:
    """Quantize the loaded 16-bit weights of the quantized layers, one layer at a time (the e4m3 copy replaces the
    16-bit one at once, so memory peaks at the 16-bit model)."""
    for _, layer in quantized_layers(model, cfg):
        w = layer.weight.data
        if cfg.block is None:
            w_q, scale = quantize_per_channel(w)
            layer.weight_scale = _param(scale)
        else:
            w_q, scale = quantize_blocks(w, cfg.block)
            layer.weight_scale_inv = _param(scale)
        layer.weight = _param(w_q)
        layer.quant = Fp8LinearMethod(cfg)
        del w
    _prepare_kernels(model)


def _prepare_kernels(model: nn.Module) -> None:
    """On CUDA, find out once (outside any CUDA graph) which FP8 GEMMs this device and torch build can run."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        from kernels.scaled_mm import probe_scaled_mm

        probe_scaled_mm(device)
