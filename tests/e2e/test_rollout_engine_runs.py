"""Every variant trains with the rollout engine (generator.engine=rollout), and the greedy held-out
evaluation before training gives the same numbers with it as with the HF engine."""

import json

import pytest

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

VARIANTS = {"grpo": [], "dapo": ["+variant=dapo"],
            "cpo": ["+variant=cpo"], "graded_prompt": ["+variant=graded_prompt"],
            "mtpo": ["+variant=mtpo", "rollout.n=8", "mtpo.max_answer_length=24", "mtpo.max_confidence_length=16"]}


def run(tmp_path, variant, engine):
    """One training step (after the step-0 evaluation); its metrics records."""
    name = f"{variant}_{engine}"
    cfg = load_config("base", SMALL_MODEL + VARIANTS[variant] + [
        f"generator.engine={engine}", "rollout.max_response_length=16", "trainer.total_steps=1",
        "trainer.tensorboard=false", f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}"])
    train(cfg)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_trains_with_the_rollout_engine(tmp_path, variant):
    records = run(tmp_path, variant, "rollout")
    assert [r["step"] for r in records] == [0, 1]
    if variant == "dapo":  # the barely warmed-up model's groups all agree: every batch is filtered
        assert records[1]["dynamic_sampling/generated_groups"] >= 4
    else:
        assert records[1]["batch/num_samples"] > 0 and "actor/grad_norm" in records[1]
    if variant == "grpo":  # float32, temperature 1, no top-p: the engine's log-probs are the trainer's
        assert records[1]["rollout/logprob_diff_max"] < 1e-4


@pytest.mark.parametrize("variant", ["grpo", "mtpo"])
def test_greedy_evaluation_is_the_same_with_either_engine(tmp_path, variant):
    before = {engine: run(tmp_path, variant, engine)[0] for engine in ("hf", "rollout")}
    val = {key: value for key, value in before["hf"].items() if key.startswith("val/")}
    assert len(val) >= 2
    assert {key: before["rollout"][key] for key in val} == val
