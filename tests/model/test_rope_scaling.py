"""RoPE scaling and the config fields the dense families differ in: our frequencies against transformers' own rope
init functions (exactly, float32), both spellings of the rope parameters, clear refusals, and the sliding-window
rule; the fused RoPE kernel without q/k norms against the torch path."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels.qk_norm_rope import KVStore, qk_norm_rope_
from model.config import ModelConfig, RopeScaling
from model.rotary import RotaryEmbedding, rope_inv_freq

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA31["original_max_position_embeddings"] = 8192
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

# (head_dim, theta, max_position_embeddings, rope parameters)
VARIANTS = {
    "linear": (64, 10_000.0, 4096, {"rope_type": "linear", "factor": 2.0}),
    "llama3.1": (128, 500_000.0, 131072, LLAMA31),
    "llama3-tiny-context": (32, 500_000.0, 2048, {**LLAMA31, "original_max_position_embeddings": 32}),
    "qwen3-yarn": (128, 1_000_000.0, 131072, QWEN3_YARN),
    "yarn-mscale": (
        64,
        1e4,
        16384,
        {
            **QWEN3_YARN,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
        },
    ),
    "yarn-untruncated": (32, 1e6, 256, {**QWEN3_YARN, "truncate": False, "original_max_position_embeddings": 64}),
    "yarn-attention-factor": (
        32,
        1e6,
        512,
        {**QWEN3_YARN, "original_max_position_embeddings": 128, "attention_factor": 1.25, "beta_slow": 2},
    ),
}


def raw_config(head_dim, theta, max_pos, rope, spelling="5.x", arch="LlamaForCausalLM") -> dict:
    raw = dict(
        architectures=[arch],
        vocab_size=100,
        hidden_size=4 * head_dim,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        dtype="float32",
    )
    if spelling == "5.x":
        raw["rope_parameters"] = {**rope, "rope_theta": theta}
    else:  # 4.x: rope_scaling with its type under "type"; rope_theta and partial_rotary_factor beside it
        rope = dict(rope)
        if "partial_rotary_factor" in rope:
            raw["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        scaling = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
        raw.update(rope_scaling=scaling if rope.get("rope_type", "default") != "default" else None, rope_theta=theta)
    return raw


@pytest.mark.parametrize("name", list(VARIANTS))
def test_frequencies_and_cos_sin_equal_transformers(name):
    head_dim, theta, max_pos, rope = VARIANTS[name]
    hf_config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters={**rope, "rope_theta": theta},
    )
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    cfg = ModelConfig.from_dict(raw_config(head_dim, theta, max_pos, rope))
    inv_freq, factor = rope_inv_freq(head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(inv_freq, ref_inv_freq.float())
    assert factor == pytest.approx(ref_factor, rel=1e-15)
    if rope["rope_type"] == "yarn":
        assert factor != 1.0  # the attention factor really is in play
    # the cached cos/sin rows are HF's (scaled by the attention factor), position for position
    positions = torch.tensor([[p for p in (0, 1, 7, 31, 200, 1000, 40000) if p < max_pos] + [max_pos - 1]])
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    table = RotaryEmbedding(head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling).cos_sin[positions[0]]
    half = head_dim // 2
    assert torch.equal(table[:, :half], cos[0, :, :half]) and torch.equal(table[:, half:], sin[0, :, :half])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_both_spellings_read_the_same(name):
    head_dim, theta, max_pos, rope = VARIANTS[name]
    new = ModelConfig.from_dict(raw_config(head_dim, theta, max_pos, rope, "5.x"))
    old = ModelConfig.from_dict(raw_config(head_dim, theta, max_pos, rope, "4.x"))
    assert new == old
    assert new.rope_scaling.rope_type == rope["rope_type"] and new.rope_theta == theta


def test_default_rope_in_both_spellings():
    new = ModelConfig.from_dict(raw_config(32, 5e5, 512, {"rope_type": "default"}, "5.x"))
    old = ModelConfig.from_dict(raw_config(32, 5e5, 512, {}, "4.x"))
    assert new == old and new.rope_scaling == RopeScaling() and new.rope_theta == 5e5


def test_a_top_level_original_context_wins_as_in_transformers():
    raw = raw_config(32, 1e6, 1024, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    raw["original_max_position_embeddings"] = 128
    assert ModelConfig.from_dict(raw).rope_scaling.original_max_position_embeddings == 128


@pytest.mark.parametrize(
    "rope,message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        (
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            "rope_type 'longrope' is not supported",
        ),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "'llama3' needs low_freq_factor"),
        ({"rope_type": "linear"}, "'linear' needs factor"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_rope_is_refused_by_name(rope, message):
    for spelling in ("5.x", "4.x"):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(raw_config(32, 1e4, 512, rope, spelling), source="cfg")


def test_sliding_window_only_where_layers_use_it():
    base = raw_config(32, 1e4, 32768, {"rope_type": "default"})
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.sliding_window == 4096
    mistral.check_max_model_len(4096)
    with pytest.raises(ValueError, match=r"sliding-window attention over 4096 tokens.*max_model_len=4097"):
        mistral.check_max_model_len(4097)
    assert ModelConfig.from_dict({**base, "sliding_window": None}).sliding_window is None
    # Qwen2/Qwen3 configs carry a window that only use_sliding_window (or layer_types) turns on
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "max_window_layers": 1}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).sliding_window == 4096
    full = Qwen3Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=2).to_dict()
    assert full["layer_types"] == ["full_attention"] * 2
    assert (
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": full["layer_types"]}).sliding_window
        is None
    )
    ModelConfig.from_dict({**qwen, "use_sliding_window": False}).check_max_model_len(10**6)


@pytest.mark.parametrize("store", [False, True])
def test_fused_rope_without_qk_norm_equals_the_torch_path(store):
    """The families without q/k norms use the fused kernel with the norm switched off (Triton interpreter here)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(3)
    tokens, q_heads, k_heads, head_dim = 5, 3, 1, 32
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, device=device, generator=g)
    qk = qkv[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
    v = qkv[:, (q_heads + k_heads) * head_dim :].view(tokens, k_heads, head_dim)
    rope = RotaryEmbedding(
        head_dim, 64, 1e4, ModelConfig.from_dict(raw_config(32, 1e4, 64, VARIANTS["linear"][3])).rope_scaling
    )
    rope = rope.to(device)
    positions = torch.tensor([0, 3, 17, 40, 63], device=device)
    ref_q, ref_k = rope(positions, qk[:, :q_heads].clone(), qk[:, q_heads:].clone())
    k_cache = torch.zeros(4, 4, k_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([2, 0, 9, -1, 15], device=device)
    kv_store = KVStore(v, k_cache, v_cache, slots) if store else None
    qk_norm_rope_(qk, None, None, 0.0, rope.cos_sin, positions, q_heads, kv_store)
    torch.testing.assert_close(qk[:, :q_heads], ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qk[:, q_heads:], ref_k, rtol=1e-5, atol=1e-5)
    if store:
        live = slots >= 0
        assert torch.equal(k_cache.view(-1, k_heads, head_dim)[slots[live]], qk[live, q_heads:])
        assert torch.equal(v_cache.view(-1, k_heads, head_dim)[slots[live]], v[live])
