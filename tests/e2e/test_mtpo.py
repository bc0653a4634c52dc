"""A small end-to-end MTPO run: the variant overlay builds, trains a few steps on the built-in
two-round QA task and evaluates both rounds (calibration metrics) before and after."""

import json

import pytest

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train

pytestmark = pytest.mark.slow

SMALL = [
    "+variant=mtpo",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.warmup.steps=30", "model.warmup.batch_size=16",
    "data.builtin_train_size=64", "data.builtin_val_size=8", "data.train_batch_size=4", "data.val_batch_size=8",
    "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_samples_every=1",
    "trainer.num_log_samples=2", "reward.num_workers=1",
]


def test_mtpo_run_logs_two_round_and_calibration_metrics(tmp_path):
    run = [f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2"]
    cfg = load_config("base", SMALL + run)
    assert (cfg.algorithm.experience_maker, cfg.algorithm.adv_estimator) == ("two_round", "mtpo_segments")
    summary = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in (records[0], records[2]):  # the evaluation before and after training: both rounds, greedy
        for key in ("val/accuracy", "val/mean_confidence", "val/brier", "val/ece", "val/auroc",
                    "val/valid_answer_ratio", "val/answer_stop_found_ratio", "val/confidence_parsed_ratio"):
            assert key in record, key
        assert record["val/num_prompts"] == 8
    for key in ("mtpo/valid_answer_ratio", "mtpo/answer_stop_found_ratio", "mtpo/answer_length_mean",
                "mtpo/confidence_stop_found_ratio", "mtpo/confidence_length_mean", "mtpo/answer_zero_std_fraction",
                "timing/mtpo_round1_s", "timing/mtpo_round2_s", "mtpo/round2_time_ratio", "reward/accuracy"):
        assert key in records[1], key
    assert records[1]["batch/num_samples"] == 4 * 8  # 4 prompts x G = 2 answers x H = 4 confidences
    assert set(summary.run_means) >= {"mtpo/valid_answer_ratio", "mtpo/round2_time_ratio"}
    assert len((tmp_path / "run" / "samples.jsonl").read_text().splitlines()) == 2 * 2
