"""Kernels that apply an FP8 product's scales as they read it (kernels/fp8_rescale.py ``Unscaled``, used by
model/fp8_folded.py): the add + RMSNorm and the q/k norm + RoPE + KV store give the same bits as the rescale kernel
followed by the kernel without scales. CPU: the Triton interpreter at tiny shapes; CUDA: Qwen3-8B's widths."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_rescale, fused
from kernels.attention import value_cache
from kernels.fp8_rescale import Unscaled
from kernels.qk_norm_rope import KVStore, qk_norm_rope_
from model.rotary import RotaryEmbedding
from tests.support.interpreter_fp8 import fix_interpreter_fp8_rounding

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _gpu_like_rounding():
    if not ON_GPU:
        fix_interpreter_fp8_rounding()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def unscaled_product(m: int, n: int, g: torch.Generator) -> Unscaled:
    """What cuBLASLt leaves of an e4m3 product without its scales (large values), and the scales to apply."""
    raw = (torch.randn(m, n, generator=g) * 900).to(torch.bfloat16).to(DEVICE)
    x_s = (torch.rand(m, generator=g) * 0.02 + 1e-3).to(DEVICE)
    w_s = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(DEVICE)
    return Unscaled(raw, x_s, w_s)


@pytest.mark.parametrize("width", [4096] if ON_GPU else [96, 300])  # 300: padding columns
def test_norm_applies_the_scales_as_the_rescale_would(width):
    g = torch.Generator().manual_seed(width)
    prod = unscaled_product(5, width, g)
    res = (torch.randn(5, width, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    nw = (torch.rand(width, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    x_q, x_s, summed = fused.rmsnorm_quantized(prod, nw, 1e-6, res)
    rescaled = fp8_rescale.rescale_(prod.raw.clone(), prod.x_s, prod.w_s, None)
    q_ref, s_ref, summed_ref = fused.rmsnorm_quantized(rescaled, nw, 1e-6, res)
    assert torch.equal(summed, summed_ref) and torch.equal(x_s, s_ref) and same_bits(x_q, q_ref)
    assert not torch.equal(prod.raw, rescaled)  # the raw product is read, not rescaled in place


def test_norm_of_the_first_layer_keeps_its_input_as_the_residual():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 64, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    nw = (torch.rand(64, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    x_q, x_s, summed = fused.rmsnorm_quantized(x, nw, 1e-6, None)
    q_ref, s_ref, _ = fused.rmsnorm_quantized(x, nw, 1e-6, torch.zeros_like(x))
    assert summed is x and torch.equal(x_s, s_ref) and same_bits(x_q, q_ref)
    with pytest.raises(AssertionError, match="not a residual"):
        fused.rmsnorm_quantized(Unscaled(x, x_s, x_s.new_ones(64)), nw, 1e-6, None)


@pytest.mark.parametrize("norms", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("kv_fp8", [True, False], ids=["e4m3-cache", "bf16-cache"])
def test_qk_norm_rope_applies_the_scales_as_the_rescale_would(norms, kv_fp8):
    q_heads, k_heads, head_dim = (32, 8, 128) if ON_GPU else (4, 2, 16)
    tokens, blocks, page = 6, 4, 4
    g = torch.Generator().manual_seed(3)
    prod = unscaled_product(tokens, (q_heads + 2 * k_heads) * head_dim, g)
    w = [(torch.rand(head_dim, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE) for _ in range(2)] if norms else []
    rope = RotaryEmbedding(head_dim, 64, 1e6).to(DEVICE)
    positions = torch.arange(tokens, device=DEVICE) + 3
    slots = torch.tensor([5, 0, -1, 15, 9, 2], device=DEVICE)  # -1: a padding token, nothing written

    def run(qkv: torch.Tensor, scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk = qkv[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
        v = qkv[:, (q_heads + k_heads) * head_dim :].view(tokens, k_heads, head_dim)
        shape = (blocks, page, k_heads, head_dim)
        k_cache = torch.zeros(shape, device=DEVICE).to(FP8 if kv_fp8 else torch.bfloat16)
        v_cache = value_cache(torch.zeros(shape, device=DEVICE).to(k_cache.dtype))
        store = KVStore(v, k_cache, v_cache, slots, 0.5 if kv_fp8 else 1.0, 2.0 if kv_fp8 else 1.0)
        wq, wk = w if norms else (None, None)
        qk_norm_rope_(qk, wq, wk, 1e-6, rope.cos_sin, positions, q_heads, store, scales)
        return qk[:, :q_heads], k_cache, v_cache

    raw = prod.raw.clone()
    got = run(raw, (prod.x_s, prod.w_s))
    want = run(fp8_rescale.rescale_(prod.raw.clone(), prod.x_s, prod.w_s, None), None)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert got[1].float().abs().sum() > 0 and got[2].float().abs().sum() > 0  # the live tokens' K and V stored


def test_folded_layers_only_where_every_product_is_per_channel_fp8(tiny_untied, monkeypatch):
    """model/fp8_folded.py takes a model whose every layer has four per-channel FP8 products without biases on one
    rank, and only CUDA steps of 2-256 16-bit rows (so never on the CPU)."""
    from model import fp8_folded
    from model.fp8 import Fp8Config
    from model.fp8_linear import Fp8LinearMethod
    from model.loader import load_model

    cpu = torch.device("cpu")
    model = load_model(tiny_untied, cpu, torch.bfloat16, quantization="fp8")
    layers = model.model.layers
    assert fp8_folded._takes_model(layers)
    assert not fp8_folded.applies(model.model, torch.zeros(4, layers[0].input_layernorm.weight.numel()))  # CPU
    assert not fp8_folded._takes_model(load_model(tiny_untied, cpu, torch.bfloat16).model.layers)  # 16-bit weights
    o_proj = layers[1].self_attn.o_proj
    with monkeypatch.context() as m:
        m.setattr(o_proj, "quant", Fp8LinearMethod(Fp8Config(block=(128, 128))))  # one layer's block scales
        assert not fp8_folded._takes_model(layers)
    with monkeypatch.context() as m:
        m.setattr(o_proj, "bias", torch.nn.Parameter(torch.zeros(o_proj.weight.shape[0]), requires_grad=False))
        assert not fp8_folded._takes_model(layers)
