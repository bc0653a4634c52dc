"""`generator.engine=auto` (the default) picks the rollout engine only where it is measured faster:
the HF backend on a GPU with a decoder the rollout engine runs; the HF engine everywhere else."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from aligner_ext.config import load_config
from aligner_ext.trainer.build import generation_engine_name


def model_on(device: str, config):
    parameter = SimpleNamespace(device=torch.device(device))
    return SimpleNamespace(parameters=lambda: iter([parameter]), config=config)


@pytest.mark.parametrize("device, backend, config, expected", [
    ("cuda", "hf", LlamaConfig(), "rollout"),
    ("cpu", "hf", LlamaConfig(), "hf"),  # CUDA graphs and compilation are GPU-only; the HF engine is the CPU reference
    ("cuda", "megatron", LlamaConfig(), "hf"),  # its generation copy is refit by the backend: not measured yet
    ("cuda", "hf", GPT2Config(), "hf"),  # an architecture the rollout engine does not run
])
def test_auto_resolves_by_device_backend_and_architecture(device, backend, config, expected):
    cfg = load_config("base", [f"policy.backend={backend}"])
    assert cfg.generator.engine == "auto"
    assert generation_engine_name(cfg, model_on(device, config)) == expected


@pytest.mark.parametrize("engine", ["hf", "rollout"])
def test_an_explicit_engine_is_kept(engine):
    cfg = load_config("base", [f"generator.engine={engine}"])
    assert generation_engine_name(cfg, model_on("cpu" if engine == "rollout" else "cuda", LlamaConfig())) == engine
