"""`policy.kernels=liger` patches the HF model instance with Liger-Kernel's norm, SwiGLU and RoPE (its
fused cross-entropy left off), only on a CUDA device and a supported decoder; checked against a fake
`liger_kernel` (Triton does not run on the CPU machines the tests run on)."""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from aligner_ext.config import load_config
from aligner_ext.errors import ConfigError
from aligner_ext.models.family_configs import family_config
from aligner_ext.models import kernels
from aligner_ext.models.kernels import apply_kernels, compile_partial_rotary, patch_projection_qk_norms, patch_with_liger


@pytest.fixture
def fake_liger(monkeypatch):
    calls = []
    transformers = types.ModuleType("liger_kernel.transformers")
    for name in ("apply_liger_kernel_to_llama", "apply_liger_kernel_to_qwen2", "apply_liger_kernel_to_qwen3"):
        setattr(transformers, name, lambda _name=name, **kwargs: calls.append((_name, kwargs)))
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers)
    return calls


def test_liger_patches_the_instance_without_its_cross_entropy(fake_liger, tiny_model):
    patch_with_liger(tiny_model)
    assert fake_liger == [("apply_liger_kernel_to_llama", {
        "model": tiny_model, "rope": True, "rms_norm": True, "swiglu": True,
        "cross_entropy": False, "fused_linear_cross_entropy": False})]


def test_none_and_auto_on_the_cpu_change_nothing_and_liger_needs_cuda(fake_liger, tiny_model):
    assert apply_kernels(tiny_model, "none") == "none"
    assert apply_kernels(tiny_model, "auto") == "none"  # the tiny model is on the CPU
    with pytest.raises(ConfigError, match="needs the policy on a CUDA device"):
        apply_kernels(tiny_model, "liger")
    assert fake_liger == []


def test_auto_takes_liger_where_it_runs(fake_liger, tiny_model, monkeypatch):
    import aligner_ext.models.kernels as kernels

    assert not kernels.liger_runs(tiny_model)  # a CPU model
    monkeypatch.setattr(kernels, "liger_runs", lambda model: True)
    with pytest.raises(ConfigError, match="CUDA"):  # auto resolved to liger, which checks the device itself
        apply_kernels(tiny_model, "auto")


def test_unsupported_decoders_a_missing_package_and_bad_names_are_refused(monkeypatch, tiny_model):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(ConfigError, match=r"pip install 'aligner_ext\[liger\]'"):
        patch_with_liger(tiny_model)
    tiny_model.config.model_type = "gpt2"
    with pytest.raises(ConfigError, match="not 'gpt2'"):
        patch_with_liger(tiny_model)
    with pytest.raises(ValueError, match="^policy.kernels='fast': must be one of auto, none, liger$"):
        load_config("base", ["policy.kernels=fast"])


@pytest.mark.parametrize("family, partial, expected", [
    ("gemma3_text", 1.0, {"geglu": True, "rope": True}),  # GeGLU MLP: Liger's geglu kernel
    ("phi3", 0.75, {"swiglu": True, "rope": False}),  # partial rotary: transformers' RoPE kept
    ("phi3", 1.0, {"swiglu": True, "rope": True}),
])
def test_liger_patch_of_each_family_takes_its_mlp_kernel_and_rope_only_for_whole_heads(monkeypatch, family, partial,
                                                                                       expected):
    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    setattr(fake, f"apply_liger_kernel_to_{family}", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=64, vocab_size=100, max_position_embeddings=64)
    config = family_config(family, **sizes)
    if family == "phi3":
        config.rope_parameters["partial_rotary_factor"] = partial
        half = int(8 * partial) // 2
        config.rope_parameters.update(short_factor=[1.0] * half, long_factor=[1.0] * half)
    model = AutoModelForCausalLM.from_config(config)
    modeling = sys.modules[type(model).__module__]
    eager_rotary = modeling.apply_rotary_pos_emb
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", eager_rotary)  # restored after the test
    patch_with_liger(model)
    assert len(calls) == 1 and calls[0]["model"] is model
    assert {key: calls[0][key] for key in expected} == expected
    assert calls[0]["cross_entropy"] is False and calls[0]["fused_linear_cross_entropy"] is False
    # a partial rotary runs transformers' own function compiled; a whole one leaves it to Liger's patch
    rotary = modeling.apply_rotary_pos_emb
    assert getattr(rotary, "_torchdynamo_orig_callable", None) is (eager_rotary if partial < 1 else None)
    if partial < 1:
        patch_with_liger(model)  # a second policy in the process compiles the original again, not the wrapper
        assert modeling.apply_rotary_pos_emb._torchdynamo_orig_callable is eager_rotary


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_liger_takes_olmo_q_k_norms_over_the_projection_with_olmo_formula(monkeypatch, family):
    patched = []
    fake = types.ModuleType("liger_kernel.transformers")
    setattr(fake, f"apply_liger_kernel_to_{family}", lambda **kwargs: None)
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch._patch_rms_norm_module = lambda module, **kwargs: patched.append((module, kwargs))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", monkey_patch)
    config = family_config(family, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=64, vocab_size=100, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)
    patch_with_liger(model)
    norms = [norm for layer in model.model.layers for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert [module for module, _ in patched] == norms
    # OLMo multiplies by the weight in float32 before the cast: Liger's gemma casting with no offset
    assert all(kwargs == {"offset": 0.0, "casting_mode": "gemma", "in_place": False} for _, kwargs in patched)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's Triton kernels and inductor's need a GPU")
def test_on_a_gpu_the_patched_olmo_norms_and_compiled_partial_rotary_compute_transformers_formulas(monkeypatch):
    """The real kernels against transformers' eager modules, bf16: the norm to its float32 result
    rounded once, the rotary to bf16 rounding (eager rounds after each op, the compiled kernel once)."""
    sizes = dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=128, max_position_embeddings=256)
    olmo = AutoModelForCausalLM.from_config(family_config("olmo2", **sizes), dtype=torch.bfloat16).cuda()
    norm = olmo.model.layers[0].self_attn.q_norm
    torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    x = torch.randn(3, 17, 256, device="cuda", dtype=torch.bfloat16)
    eager = norm(x)
    patch_projection_qk_norms(olmo)
    torch.testing.assert_close(norm(x), eager, rtol=0, atol=0.02)
    assert norm.forward.__func__.__qualname__ == "LigerRMSNorm.forward"

    phi = AutoModelForCausalLM.from_config(family_config("phi3", **sizes))
    modeling = sys.modules[type(phi).__module__]
    eager_rotary = modeling.apply_rotary_pos_emb
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", eager_rotary)
    q, k = (torch.randn(2, heads, 33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for heads in (4, 2))
    angles = torch.rand(2, 33, 48, device="cuda") * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    expected = eager_rotary(q, k, cos, sin)
    compile_partial_rotary("phi3")
    got = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0.016, atol=0.016)
        assert torch.equal(a[..., 48:], b[..., 48:])  # the unrotated part passes through
    (got[0].float().sum() + got[1].float().sum()).backward()
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("cudnn_attention", [False, True])
def test_a_gpu_process_leaves_cudnn_out_of_sdpa_unless_asked(cudnn_attention, monkeypatch):
    """A GPU run (`train` and `serve`) leaves SDPA FlashAttention and the memory-efficient kernel
    (policy.cudnn_attention=false): cuDNN's plan per new shape made every new prompt width a slow step
    (docs/benchmarks.md); true keeps torch's choice."""
    monkeypatch.setattr(kernels, "start_compile_workers", lambda: None)
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        kernels.prepare_gpu_process(cudnn_attention)
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_attention
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
