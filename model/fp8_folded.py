"""Dense FP8 decoder layers for decode-sized batches, each product's scales applied by the kernel that reads it.

From 2 to ``fp8_rescale.MAX_ROWS`` rows a per-channel FP8 product runs on cuBLASLt without its scales, and a
rescale kernel applies the token's and the channel's scales after it (kernels/fp8_rescale.py). In a dense layer
each such product is read next by a kernel that reads all of it anyway: qkv by the q/k norm + RoPE (which also
stores V), o_proj by the add + RMSNorm in front of the MLP, down_proj by the next layer's add + RMSNorm; gate/up
already by the MLP's middle (kernels/fp8_mlp.py). Here those kernels apply the scales (``Unscaled``) with the
rescale's arithmetic and rounding, so the hidden states are the same bits and three launches a layer go.
Taken on one rank for models whose every layer is attention + gated MLP with per-channel FP8 weights and no
biases; otherwise, and for other row counts, the layers' own forward runs.
"""

from __future__ import annotations

import torch
from torch import nn

from comm.parallel import tp_size
from kernels import fp8_mlp, fp8_rescale, fused
from kernels.fp8_gemm import GEMV_ROWS
from kernels.fp8_quant import quantize_rows
from kernels.fp8_rescale import Unscaled
from kernels.scaled_mm import unscaled_mm, uses_scaled_mm


def _linears(layer: nn.Module) -> tuple[nn.Module, ...] | None:
    """A layer's (qkv, o, gate/up, down) projections, or None if its MLP is not a gated one (a MoE layer)."""
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):
        return None
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _takes_model(layers: nn.ModuleList) -> bool:
    """Every layer dense, its four products per-channel FP8 without a bias; one rank."""
    if tp_size() != 1 or len(layers) == 0:
        return False
    for layer in layers:
        linears = _linears(layer)
        if linears is None or any(p.quant is None or p.quant.cfg.block is not None for p in linears):
            return False
        if any(p.bias is not None for p in linears):
            return False
    return True


def applies(model: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether ``model`` (a DecoderModel) runs this step's ``hidden`` rows [M, H] through ``layer_forward``."""
    m = hidden.shape[0]
    if not (hidden.is_cuda and hidden.dtype != torch.float32 and GEMV_ROWS < m and fp8_rescale.applies(m)):
        return False
    takes = getattr(model, "_fp8_folds", None)
    if takes is None:  # the layers are quantized after the model is built: decided at the first CUDA step
        takes = model._fp8_folds = _takes_model(model.layers)
    if not takes:
        return False
    qkv, o, gate_up, down = _linears(model.layers[0])
    on_lt = all(uses_scaled_mm(*p.weight.shape, None, hidden.device) for p in (qkv, o))
    return on_lt and fp8_mlp.applies(m, gate_up.weight, down.weight)


def _product(x_q: torch.Tensor, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``x_q @ layer.weight.T`` of e4m3 operands without their scales, in ``dtype``."""
    out = torch.empty((x_q.shape[0], layer.weight.shape[0]), dtype=dtype, device=x_q.device)
    return unscaled_mm(x_q, layer.weight, out)


def layer_forward(
    layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor | Unscaled, residual: torch.Tensor | None
) -> tuple[Unscaled, torch.Tensor]:
    """A DecoderLayer's forward: ``hidden`` the embedding (``residual`` None) or the previous layer's unscaled
    down product; returns this layer's down product, unscaled, and the residual stream."""
    attn, qkv, o, gate_up, down = layer.self_attn, *_linears(layer)
    norm = layer.input_layernorm
    x_q, x_s, residual = fused.rmsnorm_quantized(hidden, norm.weight, norm.eps, residual)
    layer.capture(residual)
    dtype = residual.dtype
    a = attn.attend(positions, _product(x_q, qkv, dtype), (x_s, qkv.weight_scale))
    a_q, a_s = quantize_rows(a, None)
    norm = layer.post_attention_layernorm
    o_out = Unscaled(_product(a_q, o, dtype), a_s, o.weight_scale)
    h_q, h_s, residual = fused.rmsnorm_quantized(o_out, norm.weight, norm.eps, residual)
    m_q, m_s = fp8_mlp.silu_mul_quant(_product(h_q, gate_up, dtype), h_s, gate_up.weight_scale)
    return Unscaled(_product(m_q, down, dtype), m_s, down.weight_scale), residual
