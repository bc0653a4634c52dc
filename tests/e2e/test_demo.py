"""Small end-to-end runs of the embedded default job: outputs of a run, and exact resume."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

SMALL = SMALL_MODEL + [
    "rollout.max_response_length=12", "trainer.tensorboard=true", "trainer.log_samples_every=1",
    "trainer.num_log_samples=2",
]


def small_config(tmp_path, *extra):
    return load_config("base", SMALL + [f"trainer.output_dir={tmp_path}", *extra])


def test_demo_run_writes_its_outputs(tmp_path):
    summary = train(small_config(tmp_path, "trainer.total_steps=3", "trainer.run_name=run"))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("reward/mean", "reward/accuracy", "reward/zero_std_group_fraction", "actor/clip_frac_low",
                "actor/clip_frac_high", "actor/entropy", "actor/grad_norm", "advantage/min", "advantage/max",
                "response/length_mean", "timing/rollout_s", "timing/train_s", "timing/tokens_per_s"):
        assert key in records[1], key
    assert "val/accuracy" in records[0] and "val/accuracy" in records[3]
    assert summary.accuracy_before == records[0]["val/accuracy"]
    assert summary.accuracy_after == records[3]["val/accuracy"]
    assert (run / "reward_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rollout:" in (run / "config.yaml").read_text()
    assert len((run / "samples.jsonl").read_text().splitlines()) == 3 * 2
    assert list((run / "tensorboard").iterdir())
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    final = load_file(str(run / "checkpoints" / "step_3" / "model.safetensors"))
    for name, tensor in exported.state_dict().items():
        if name in final:
            torch.testing.assert_close(tensor, final[name], rtol=0, atol=0)

    # the same command trains a given HF checkpoint instead of building the embedded model
    again = train(small_config(tmp_path, "trainer.total_steps=1", "trainer.run_name=from_path",
                               f"model.path={run / 'hf_model'}"))
    assert not (tmp_path / "from_path" / "base_model").exists()
    assert again.accuracy_before == summary.accuracy_after  # it starts from the exported weights


DENSE_REWARD = "+reward.sources.arithmetic=e2e_rewards.digit_fraction"  # tests/e2e/e2e_rewards.py


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: its float32 master weights resume too
def test_resume_continues_the_same_run(tmp_path, monkeypatch, caplog, dtype):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the reward workers inherit sys.path
    run = ["trainer.total_steps=4", "trainer.save_every=2", DENSE_REWARD, f"policy.dtype={dtype}"]
    straight = small_config(tmp_path, *run, "trainer.run_name=a")
    train(straight)
    # the same run, killed after its step-2 checkpoint: drop step 4 and point `latest` back at step 2
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_4")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_2")
    resumed = small_config(tmp_path, *run, "trainer.run_name=b")
    with caplog.at_level(logging.WARNING, logger="aligner_ext.trainer.loop"):
        train(resumed)
    # the copied checkpoint was saved under the name `a`: the resume names that, and nothing else, as changed
    changed = [r.getMessage() for r in caplog.records if "changed since it was saved" in r.getMessage()]
    assert len(changed) == 1
    assert changed[0].endswith("with 1 setting(s) changed since it was saved: trainer.run_name: a -> b")

    weights_a = load_file(str(tmp_path / "a" / "checkpoints" / "step_4" / "model.safetensors"))
    weights_b = load_file(str(tmp_path / "b" / "checkpoints" / "step_4" / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=0, atol=0)

    def without_timings(path):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]

    assert without_timings(tmp_path / "b" / "metrics.jsonl") == without_timings(tmp_path / "a" / "metrics.jsonl")
    # the weights did move during training (the comparison above is not between two untouched models)
    base = load_file(str(tmp_path / "a" / "checkpoints" / "step_2" / "model.safetensors"))
    assert any(not torch.equal(base[name], weights_a[name]) for name in base)


def test_kl_to_the_reference_policy_is_computed_and_reported(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    train(small_config(tmp_path, "trainer.total_steps=2", "trainer.run_name=kl", "loss.kl_coef=0.1",
                       "loss.kl_estimator=k3", DENSE_REWARD))
    records = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    # step 1 starts from the reference weights, so KL is 0; after one update the policy has moved
    assert records[1]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert records[2]["actor/kl"] > 0.0
    assert records[2]["loss/kl"] == pytest.approx(0.1 * records[2]["actor/kl"], rel=1e-5)
