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
