"""`generator.engine=auto` (the default) picks the rollout engine only where it is measured faster:
on a GPU with a decoder the rollout engine runs, on the HF backend or on the Megatron backend's
shards (with pipeline stages resharded in memory); the HF engine everywhere else."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from aligner_ext.config import load_config
from aligner_ext.trainer.build import generation_engine_name


@pytest.mark.parametrize("device, overrides, config, expected", [
    ("cuda", ["policy.backend=hf"], LlamaConfig(), "rollout"),
    ("cpu", ["policy.backend=hf"], LlamaConfig(), "hf"),  # CUDA graphs and compilation are GPU-only; the HF engine is the CPU reference
    ("cuda", ["policy.backend=megatron"], LlamaConfig(), "rollout"),  # on the GPTModel's shards
    ("cpu", ["policy.backend=megatron"], LlamaConfig(), "hf"),
    # every rank gathers the other stages' layers (decoder.PipelineGather)
    ("cuda", ["policy.backend=megatron", "policy.pipeline_model_parallel_size=2"], LlamaConfig(), "rollout"),
    ("cuda", ["policy.backend=hf"], GPT2Config(), "hf"),  # an architecture the rollout engine does not run
])
def test_auto_resolves_by_device_backend_and_architecture(device, overrides, config, expected):
    cfg = load_config("base", overrides)
    assert cfg.generator.engine == "auto"
    assert generation_engine_name(cfg, config, torch.device(device)) == expected


@pytest.mark.parametrize("engine", ["hf", "rollout"])
def test_an_explicit_engine_is_kept(engine):
    cfg = load_config("base", [f"generator.engine={engine}"])
    assert generation_engine_name(cfg, LlamaConfig(), torch.device("cpu" if engine == "rollout" else "cuda")) == engine
