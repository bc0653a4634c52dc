"""The agents demo overlay (conf/demo_agents.yaml) end to end, shrunk: the warm-up learns the copying
drills, then the gold transcripts' turns, the calculator episodes train and evaluate with a defined held-out accuracy."""

import json

import pytest

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from tests.e2e.small_run import SMALL_MODEL

pytestmark = pytest.mark.slow


def test_the_agents_demo_runs_calculator_episodes(tmp_path, caplog):
    run = [f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=1", "trainer.eval.every=1",
           "model.warmup.cache_dir=none", "trainer.tensorboard=false", "rollout.max_response_length=16", "model.warmup.drill_steps=3"]
    caplog.set_level("INFO", logger="aligner_ext.trainer.build")
    caplog.set_level("INFO", logger="aligner_ext.models.warmup")
    train(load_config("demo_agents", SMALL_MODEL + run))
    # 64 rows, two model turns each in their gold transcripts
    assert "warming up the embedded model on 128 examples from 64 calculator_arithmetic rows" in caplog.text
    assert caplog.text.index("drills: 3 steps") < caplog.text.index("warm-up: 30 steps")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["batch/num_samples"] == 16 and 1 <= records[1]["agent/turns"] <= 2  # 4 prompts x 4 episodes
    for record in records:  # the calculator's score says whether an episode was right
        assert record["val/num_prompts"] == 8 and 0.0 <= record["val/accuracy"] <= 1.0
