"""One tiny GRPO step on the embedded model with each estimator, loss, off-policy correction and DAPO's
overlong techniques switched on: the run trains (an update is applied) and logs each one's metrics."""

import json
from pathlib import Path

import pytest
from small_run import SMALL_MODEL

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train

pytestmark = pytest.mark.slow

CASES = {
    "rloo": (["algorithm.adv_estimator=rloo"], []),
    "reinforce_pp": (["algorithm.adv_estimator=reinforce_plus_plus"], ["advantage/batch_std"]),
    "reinforce_pp_baseline": (["algorithm.adv_estimator=reinforce_plus_plus_baseline"], ["advantage/batch_std"]),
    "gspo": (["algorithm.loss=gspo", "loss.agg_mode=seq-mean-token-mean",
              "loss.off_policy_correction=sequence_mask"], ["actor/seq_ratio_mean", "actor/is_masked_frac"]),
    "cispo": (["algorithm.loss=cispo", "loss.off_policy_correction=sequence_tis", "loss.importance_sampling_cap=2"],
              ["actor/clip_frac_high", "actor/is_capped_frac"]),
    "dapo_overlong": (["+variant=dapo", "dynamic_sampling.filter_metric=seq_reward", "rollout.overlong_filter=true",
                       "loss.off_policy_correction=token_mask"],
                      ["overlong/penalty_mean", "overlong/filtered_fraction", "actor/is_masked_frac"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_step_trains_and_logs_its_metrics(tmp_path, monkeypatch, case):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # reward workers import e2e_rewards
    overrides, expected_metrics = CASES[case]
    cfg = load_config("base", SMALL_MODEL + overrides + [
        "+reward.sources.arithmetic=e2e_rewards.digit_fraction",  # dense: every group has a spread
        "trainer.total_steps=1", "trainer.tensorboard=false", "rollout.max_response_length=12",
        "model.warmup.steps=10", "trainer.export_hf=false", f"trainer.output_dir={tmp_path}", "trainer.run_name=run"])
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = records[-1]
    assert step["step"] == 1 and step["actor/num_updates"] == 1.0
    for key in ["loss/total", "actor/grad_norm", *expected_metrics]:
        assert key in step and step[key] == step[key], key  # present and not NaN
