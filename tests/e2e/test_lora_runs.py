"""LoRA through the whole loop (docs/lora.md): with every variant a step trains the adapters alone,
with the KL term against the adapters-off reference, and the run leaves adapter checkpoints and an
export of merged weights with peft adapters beside them; combinations that would need a second copy
of the base are refused before anything loads."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from small_run import SMALL_MODEL

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train

pytestmark = pytest.mark.slow

VARIANTS = {
    "grpo": [],
    "dapo": ["+variant=dapo", "+reward.sources.arithmetic=e2e_rewards.digit_fraction"],  # partial credit: groups vary
    "graded_prompt": ["+variant=graded_prompt"],
    "mtpo": ["+variant=mtpo", "mtpo.num_confidence_generations=2"],  # G x H = rollout.n=4
    "cpo": ["+variant=cpo"],
    "grpo_rollout_engine": ["generator.engine=rollout"],  # the adapters inside the engine's decode step
}
LORA = ["policy.lora.rank=4", "policy.lora.alpha=8", "policy.optim.lr=1e-3", "loss.kl_coef=0.01"]


def lora_run(tmp_path, name: str, overrides: list[str], steps: int = 1):
    return load_config("base", SMALL_MODEL + LORA + overrides + [
        f"trainer.total_steps={steps}", "trainer.tensorboard=false", "rollout.max_response_length=16",
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_lora_step_runs_with_every_variant(tmp_path, variant):
    cfg = lora_run(tmp_path, variant, VARIANTS[variant])
    train(cfg)
    run_dir = tmp_path / variant
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 1]
    assert records[1]["actor/num_updates"] >= 1 and "actor/kl" in records[1]
    checkpoint = run_dir / "checkpoints" / "step_1"
    assert not (checkpoint / "model.safetensors").exists()
    adapters = load_file(checkpoint / "adapters.safetensors")
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert json.loads((checkpoint / "base.json").read_text())["path"] == str(run_dir / "base_model")
    assert (run_dir / "hf_model" / "model.safetensors").exists()
    assert (run_dir / "hf_model" / "adapter" / "adapter_model.safetensors").exists()


def test_a_resumed_lora_run_ends_with_the_adapters_of_an_uninterrupted_one(tmp_path, caplog):
    train(lora_run(tmp_path, "straight", [], steps=2))
    train(lora_run(tmp_path, "resumed", [], steps=1))
    with caplog.at_level(logging.INFO, logger="aligner_ext.trainer.checkpoint"):
        train(lora_run(tmp_path, "resumed", [], steps=2))  # the same run, extended: resumes from step 1's adapters
    assert "(step 1)" in caplog.text
    straight, resumed = (load_file(tmp_path / name / "checkpoints" / "step_2" / "adapters.safetensors")
                         for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name


def test_lora_with_the_colocated_vllm_engine_is_refused_when_the_config_loads(tmp_path):
    with pytest.raises(ValueError, match="policy.lora.rank=4 with generator.engine=vllm: .* own copy of the base"):
        lora_run(tmp_path, "refused", ["generator.engine=vllm"])
