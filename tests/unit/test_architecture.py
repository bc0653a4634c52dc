"""The shared layer pieces of `aligner_ext/architecture.py` against transformers' own modules and hand
arithmetic: RoPE tables of every scaling type, the three RMSNorm formulas, partial rotary, Gemma's
embedding scale, and each family's per-layer plan."""

import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Olmo2Config, Phi3Config, Qwen2Config,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

from aligner_ext.architecture import (
    apply_rotary, architecture, rms_norm, rope_tables, rotary_cos_sin, scale_embedding,
)
from aligner_ext.models.family_configs import family_config

TINY = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64, vocab_size=100, max_position_embeddings=64)
ROPE_SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
}


def _llama(rope: dict) -> LlamaConfig:
    return LlamaConfig(**TINY, rope_parameters=dict(rope, rope_theta=10000.0))


@pytest.mark.parametrize("name", ["default", *ROPE_SCALINGS])
def test_rotary_tables_equal_the_hf_models_rotary_embedding(name):
    config = _llama(ROPE_SCALINGS.get(name, dict(rope_type="default")))
    model = AutoModelForCausalLM.from_config(config)
    positions = torch.tensor([[0, 3, 7, 15, 40]])
    hidden = torch.zeros(1, 5, 32)
    expected_cos, expected_sin = model.model.rotary_emb(hidden, positions)
    inv_freq, scaling = rope_tables(config)["default"]
    cos, sin = rotary_cos_sin(positions, inv_freq, scaling, torch.float32)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


def test_rope_frequencies_by_hand():
    """Default: theta^(-2i/d). Linear: divided by the factor. Llama 3 with original context 16,
    factor 8, low/high frequency factors 1 and 4: wavelengths under 16/4 = 4 positions keep their
    frequency, wavelengths over 16 are divided by 8, those between are interpolated."""
    default = rope_tables(_llama(dict(rope_type="default")))["default"][0].double()
    by_hand = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64)
    assert torch.allclose(default, by_hand, rtol=1e-6)
    linear = rope_tables(_llama(ROPE_SCALINGS["linear"]))["default"][0].double()
    assert torch.allclose(linear, by_hand / 4, rtol=1e-6)
    llama3 = rope_tables(_llama(ROPE_SCALINGS["llama3"]))["default"][0].double()
    wavelengths = 2 * math.pi / by_hand  # 6.28, 62.8, 628, 6283
    assert wavelengths[0] > 4 and wavelengths[1] > 16  # no band keeps its frequency here except by interpolation
    smooth = (16 / wavelengths[0] - 1) / (4 - 1)
    assert torch.allclose(llama3[0], (1 - smooth) * by_hand[0] / 8 + smooth * by_hand[0], rtol=1e-6)
    assert torch.allclose(llama3[1:], by_hand[1:] / 8, rtol=1e-6)


def test_gemma3_keeps_a_table_per_layer_type_with_its_own_base_and_scaling():
    config = family_config("gemma3_text", **TINY, sliding_window=4)
    tables = rope_tables(config)
    assert set(tables) == {"sliding_attention", "full_attention"}
    local, _ = tables["sliding_attention"]
    global_, scaling = tables["full_attention"]  # base 1e6, linear factor 8 (family_configs)
    assert torch.allclose(local.double(), torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64))
    assert torch.allclose(global_.double(), torch.tensor([1e6 ** (-2 * i / 8) / 8 for i in range(4)], dtype=torch.float64))
    assert scaling == 1.0


@pytest.mark.parametrize("formula, module", [
    ("llama", LlamaRMSNorm(16, eps=1e-6)), ("gemma", Gemma3RMSNorm(16, eps=1e-6)), ("float32_scale", Olmo2RMSNorm(16, eps=1e-6)),
])
def test_rms_norm_formulas_equal_the_families_modules_in_bf16(formula, module):
    with torch.no_grad():
        module.weight.copy_(torch.randn(16) * 0.3 + (0.0 if formula == "gemma" else 1.0))
    module = module.to(torch.bfloat16)
    x = (torch.randn(3, 5, 16) * 4).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, module.weight, 1e-6, formula), module(x))
    # float64 by hand: x / rms(x) times w (Llama, OLMo) or (1 + w) (Gemma)
    x64, w64 = x.double(), module.weight.double()
    normed = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = normed * ((1 + w64) if formula == "gemma" else w64)
    assert torch.allclose(rms_norm(x, module.weight, 1e-6, formula).double(), expected, atol=0.05, rtol=0.02)


def test_partial_rotary_rotates_the_leading_dimensions_only_as_phi3_does():
    config = Phi3Config(**TINY, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    inv_freq, scaling = rope_tables(config)["default"]
    assert inv_freq.numel() == 2  # a quarter of the head: half the head rotates, in pairs
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = rotary_cos_sin(torch.arange(5)[None].expand(2, 5), inv_freq, scaling, torch.float32)
    expected_q, expected_k = phi3_apply_rotary(q, k, cos, sin)
    assert torch.equal(apply_rotary(q, cos[:, None], sin[:, None]), expected_q)
    assert torch.equal(apply_rotary(k, cos[:, None], sin[:, None]), expected_k)
    assert torch.equal(apply_rotary(q, cos[:, None], sin[:, None])[..., 4:], q[..., 4:])


def test_gemma_embedding_scale_equals_the_scaled_embedding_in_bf16():
    embedding = Gemma3TextScaledWordEmbedding(50, 48, padding_idx=0, embed_scale=48 ** 0.5).to(torch.bfloat16)
    ids = torch.tensor([[1, 7, 49]])
    plain = torch.nn.functional.embedding(ids, embedding.weight)
    assert torch.equal(scale_embedding(plain, 48 ** 0.5), embedding(ids))


def test_layer_plans_of_each_family():
    gemma = architecture(family_config("gemma3_text", **dict(TINY, num_hidden_layers=7), sliding_window=4))
    assert [layer.window for layer in gemma.layers] == [4, 4, 4, 4, 4, None, 4]  # every sixth layer global
    assert [layer.rope for layer in gemma.layers][4:6] == ["sliding_attention", "full_attention"]
    assert gemma.softmax_scale == 256 ** -0.5 and gemma.embedding_scale == math.sqrt(32)  # query_pre_attn_scalar 256
    smol = architecture(family_config("smollm3", **TINY))
    assert [layer.rope for layer in smol.layers] == ["default", "default", "default", None]  # every fourth NoPE
    mistral = architecture(family_config("mistral", **TINY, sliding_window=4))
    assert {layer.window for layer in mistral.layers} == {4}
    qwen2 = architecture(Qwen2Config(**TINY, sliding_window=4, use_sliding_window=False))
    assert {layer.window for layer in qwen2.layers} == {None} and qwen2.qkv_bias
    olmo = architecture(Olmo2Config(**TINY))
    assert olmo.norm_names == {"post_attention": "post_attention_layernorm", "post_mlp": "post_feedforward_layernorm"}
    assert olmo.qk_norm == "projection" and olmo.norm == "float32_scale"


def test_gemma3_plan_reads_the_checkpoint_layer_types():
    config = Gemma3TextConfig(**TINY, sliding_window=4, layer_types=["full_attention", "sliding_attention"] * 2)
    assert [layer.window for layer in architecture(config).layers] == [None, 4, None, 4]
