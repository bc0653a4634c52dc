"""A small end-to-end CPO run (+variant=cpo) on the embedded model and the built-in arithmetic task."""

import json
import math

import pytest

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

SMALL = SMALL_MODEL + ["rollout.max_response_length=12", "trainer.tensorboard=false", "trainer.log_samples_every=0"]


@pytest.mark.parametrize("extra", [[], ["cpo.hint.placement=assistant_turn", "cpo.wrap_method=tok_kl",
                                        "cpo.difficulty=five", "cpo.uncertainty=vocab"]], ids=["default", "options"])
def test_cpo_run_reports_hint_and_mi_metrics(tmp_path, extra):
    cfg = load_config("base", ["+variant=cpo", *SMALL, f"trainer.output_dir={tmp_path}", "trainer.run_name=run",
                               "trainer.total_steps=2", *extra])
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        assert record["cpo/hint_rows"] == 16 and record["cpo/hint_missing"] == 0
        assert record["cpo/hint_tokens_mean"] > 10  # the gold solution, e.g. "12+7=19\n\boxed{19}"
        for key in ("cpo/mi_mean", "cpo/mi_std", "cpo/mi_positive_fraction"):
            assert math.isfinite(record[key]), key
        difficulty = [v for k, v in record.items() if k.startswith("cpo/difficulty_")]
        assert sum(difficulty) == pytest.approx(1.0)  # every group has exactly one level
        assert math.isfinite(record["actor/grad_norm"])
