"""`policy.kernels=liger` patches the HF model instance with Liger-Kernel's norm, SwiGLU and RoPE (its
fused cross-entropy left off), only on a CUDA device and a supported decoder; checked against a fake
`liger_kernel` (Triton does not run on the CPU machines the tests run on)."""

import sys
import types

import pytest

from aligner_ext.errors import ConfigError
from aligner_ext.models.base import PolicyConfig
from aligner_ext.models.kernels import apply_kernels, patch_with_liger


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
    with pytest.raises(ValueError, match="policy.kernels must be auto, none or liger"):
        PolicyConfig(kernels="fast")
