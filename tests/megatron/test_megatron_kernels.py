"""`policy.kernels` on the Megatron backend: what auto resolves to, and a clear error where Liger cannot run."""

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.errors import ConfigError  # noqa: E402
from aligner_ext.models.megatron.policy import megatron_kernels  # noqa: E402


def test_auto_keeps_the_plain_modules_and_none_stays_none():
    assert megatron_kernels("auto", torch.device("cpu")) == "none"
    assert megatron_kernels("none", torch.device("cpu")) == "none"


def test_liger_on_the_cpu_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        megatron_kernels("liger", torch.device("cpu"))
