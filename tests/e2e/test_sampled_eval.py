"""A small end-to-end run with sampled evaluation on two validation sets: four responses per prompt,
pass@k, mean@k and maj@k per set and per data_source before and after training, in metrics.jsonl,
the summary and the plot."""

import json

import pytest
from small_run import SMALL_MODEL

from aligner_ext.config import load_config
from aligner_ext.data.tasks import builtin_rows
from aligner_ext.trainer.loop import train

pytestmark = pytest.mark.slow


def write_rows(path, rows, data_source):
    """Built-in rows as a jsonl file, under another data_source (scored by the same reward)."""
    records = [{"prompt": row.messages, "data_source": data_source, "reward_model": {"ground_truth": row.ground_truth}}
               for row in rows]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_sampled_evaluation_of_two_sets(tmp_path):
    rows = builtin_rows("arithmetic", "val", 4, seed=1)
    write_rows(tmp_path / "mixed.jsonl", rows[:2], "arithmetic")
    write_rows(tmp_path / "math.jsonl", rows[2:], "math")
    cfg = load_config("base", SMALL_MODEL + [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=1",
        "trainer.tensorboard=false", "rollout.max_response_length=12",
        "trainer.eval.k=4", "trainer.eval.temperature=1.0", "+data.val_sets.arith=[arithmetic]",
        f"+data.val_sets.mixed=[{tmp_path / 'mixed.jsonl'},{tmp_path / 'math.jsonl'}]"])
    summary = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        for key in ("accuracy", "mean_at_4", "pass_at_1", "pass_at_2", "pass_at_4", "maj_at_4", "reward_mean"):
            for prefix in ("val/", "val/arith/", "val/mixed/", "val/mixed/arithmetic/", "val/mixed/math/"):
                assert prefix + key in record, prefix + key
        assert (record["val/arith/num_prompts"], record["val/mixed/num_prompts"], record["val/num_prompts"]) == (
            8, 4, 12)
        for prefix in ("val/arith/", "val/mixed/"):
            assert record[prefix + "pass_at_1"] == pytest.approx(record[prefix + "mean_at_4"])
            assert record[prefix + "pass_at_1"] <= record[prefix + "pass_at_2"] <= record[prefix + "pass_at_4"]
        assert record["val/accuracy"] == pytest.approx(
            (8 * record["val/arith/accuracy"] + 4 * record["val/mixed/accuracy"]) / 12)
    assert summary.evaluation == "4 samples, temperature 1"
    assert summary.held_out_after["val/pass_at_4"] == records[1]["val/pass_at_4"]
    assert (tmp_path / "run" / "reward_accuracy.png").exists()
