"""Shared fixtures: the built-in character tokenizer and a very small Llama-architecture model."""

import pytest
import torch

from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh 2-layer model in float32, eval mode; tests that train it get their own copy."""
    model = build_tiny_model(tiny_tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                             num_kv_heads=1, intermediate_size=64, seed=0))
    return model.eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
