"""Dynamic sampling in the real loop: metrics, summary, and a step where every group is filtered."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from aligner_ext.trainer.no_learning import NO_BATCH
from test_demo import SMALL

pytestmark = pytest.mark.slow


def run(tmp_path, monkeypatch, *extra):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # reward workers import e2e_rewards
    cfg = load_config("base", SMALL + [f"trainer.output_dir={tmp_path}", "+variant=dapo", *extra])
    return train(cfg), [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_dynamic_sampling_runs_and_reports_the_filtered_fraction(tmp_path, monkeypatch):
    summary, records = run(tmp_path, monkeypatch, "trainer.total_steps=2", "trainer.run_name=run",
                           "+reward.sources.arithmetic=e2e_rewards.digit_fraction",
                           "dynamic_sampling.keep_surplus=true", "dynamic_sampling.oversample=2.0")
    for record in records[1:]:
        assert 0.0 <= record["dynamic_sampling/filtered_fraction"] <= 1.0
        assert record["dynamic_sampling/num_gen_batches"] >= 1
        assert record["dynamic_sampling/target_prompt_num"] == 4
    assert "dynamic_sampling/filtered_fraction" in summary.run_means


def test_a_step_with_every_group_filtered_makes_no_update(tmp_path, monkeypatch):
    summary, records = run(tmp_path, monkeypatch, "trainer.total_steps=2", "trainer.run_name=run",
                           "+reward.sources.arithmetic=e2e_rewards.always_wrong",
                           "dynamic_sampling.max_gen_batches=2", "trainer.no_learning_steps=2")
    for record in records[1:]:
        assert record["dynamic_sampling/filtered_fraction"] == 1.0
        assert record["dynamic_sampling/num_gen_batches"] == 2
        assert "actor/grad_norm" not in record
        assert record["rollout/identical_group_fraction"] == 0.0  # measured before the filter: samples differ
    warning, = summary.warnings  # the run that could not learn says so, with why
    assert warning.startswith("the policy could not learn in 2 of 2 steps") and NO_BATCH in warning
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "base_model").state_dict()
    final = load_file(str(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"))
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, base[name], rtol=0, atol=0)
