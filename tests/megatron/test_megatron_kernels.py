"""`policy.kernels` on the Megatron backend: what auto resolves to, and a clear error where Liger cannot run."""

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.errors import ConfigError  # noqa: E402
from aligner_ext.models.megatron.policy import megatron_kernels  # noqa: E402


def test_auto_takes_liger_only_on_a_gpu_with_the_package(monkeypatch):
    import importlib.util

    assert megatron_kernels("auto", torch.device("cpu")) == "none"
    assert megatron_kernels("none", torch.device("cuda")) == "none"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a))
    assert megatron_kernels("auto", torch.device("cuda")) == "liger"
    assert megatron_kernels("auto", torch.device("cpu")) == "none"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    assert megatron_kernels("auto", torch.device("cuda")) == "none"


def test_liger_on_the_cpu_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        megatron_kernels("liger", torch.device("cpu"))


@pytest.mark.parametrize("family, liger_norm", [("llama3", True), ("gemma3_text", True), ("olmo2", False)])
def test_liger_norms_only_where_a_liger_mode_is_the_family_formula(family, liger_norm):
    """Liger's RMSNorm computes Llama's formula (mode llama) and Gemma's (mode gemma, offset 1), not
    OLMo's float32 scaling: kernels=liger leaves OLMo's norms to the library's own."""
    from aligner_ext.models.family_configs import family_config
    from aligner_ext.models.megatron.model import (
        LigerRMSNorm,
        RMSNorm,
        norm_module,
        transformer_config,
    )

    config = family_config(family, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=64, vocab_size=100, max_position_embeddings=64)
    megatron_config = transformer_config(config, 1, 1, torch.float32, kernels="liger")
    assert norm_module(megatron_config) is (LigerRMSNorm if liger_norm else RMSNorm)
    if liger_norm:
        assert LigerRMSNorm.CASTING[megatron_config.architecture.norm] == {"llama3": (0.0, "llama"),
                                                                            "gemma3_text": (1.0, "gemma")}[family]


@pytest.mark.parametrize("kernels", ["none", "liger"])
def test_gemma_geglu_is_megatron_cores_fused_tanh_kernel_only_where_fused(kernels):
    """Gemma's GeGLU (tanh approximation): megatron-core's fused kernel takes F.gelu as the activation
    and computes the tanh approximation, forward and backward; unfused, F.gelu would be the exact erf
    GELU, so the config names it only with the fusion on."""
    import torch.nn.functional as F
    from megatron.core.fusions import fused_bias_geglu

    from aligner_ext.models.family_configs import family_config
    from aligner_ext.models.megatron.model import transformer_config

    config = family_config("gemma3_text", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=100,
                           max_position_embeddings=64)
    megatron_config = transformer_config(config, 1, 1, torch.float32, kernels=kernels)
    assert megatron_config.bias_activation_fusion is (kernels == "liger")
    y = torch.randn(5, 2 * 7, dtype=torch.float64, requires_grad=True)
    gate, up = y.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    if kernels == "none":
        assert megatron_config.activation_func is not F.gelu
        assert torch.allclose(megatron_config.activation_func(gate) * up, expected)
        return
    assert megatron_config.activation_func is F.gelu
    # the fused kernel's own functions, uncompiled (torch.compile wraps them on first call)
    forward = getattr(fused_bias_geglu.geglu, "_torchdynamo_orig_callable", fused_bias_geglu.geglu)
    backward = getattr(fused_bias_geglu.geglu_back, "_torchdynamo_orig_callable", fused_bias_geglu.geglu_back)
    assert torch.allclose(forward(y), expected, atol=1e-7)
    grad = torch.randn(5, 7, dtype=torch.float64)
    (reference,) = torch.autograd.grad(expected, y, grad)
    assert torch.allclose(backward(grad, y.detach()), reference, atol=1e-7)


@pytest.mark.parametrize("setting, refused", [
    ({}, ""), ({"dtype": "auto"}, ""),
    ({"use_distributed_optimizer": True}, "policy.use_distributed_optimizer=true needs GPUs"),
    ({"dtype": "bfloat16"}, "policy.dtype=bfloat16 on the Megatron backend needs GPUs"),
])
def test_what_megatron_cores_optimizers_cannot_run_on_the_cpu_is_refused_in_one_line(setting, refused):
    """Unrefused, megatron-core's optimizers raise a TypeError about CUDA tensor types from their constructors."""
    from aligner_ext.models.megatron.policy import cpu_refusal
    from aligner_ext.models.settings import PolicyConfig

    cfg = PolicyConfig(backend="megatron", **setting)
    assert cpu_refusal(cfg, torch.device("cpu")).startswith(refused)
    assert bool(cpu_refusal(cfg, torch.device("cpu"))) == bool(refused)
    assert cpu_refusal(cfg, torch.device("cuda")) == ""
