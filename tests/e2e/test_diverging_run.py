"""Fault injection: a run whose loss turns NaN from its third step on. The NaN updates are skipped
and counted, the run stops with one line and exit status 2 after `max_nonfinite_in_a_row`, and the
checkpoint left behind holds the last finite weights, from which a resume works."""

import json
import math

import pytest
from safetensors.torch import load_file

from aligner_ext.cli import main
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow


def test_a_diverging_run_stops_cleanly_and_keeps_a_finite_checkpoint(tmp_path, monkeypatch, capsys):
    honest = ClippedPGLoss.__call__
    calls = []

    def nan_from_the_third_update(self, logprobs, batch, counts):
        calls.append(1)
        value, metrics = honest(self, logprobs, batch, counts)
        return (value * math.nan if len(calls) > 2 else value), metrics

    monkeypatch.setattr(ClippedPGLoss, "__call__", nan_from_the_third_update)
    overrides = SMALL_MODEL + ["trainer.total_steps=6", "trainer.save_every=1", "trainer.tensorboard=false",
                               "policy.micro_batch_size=64", "policy.optim.max_nonfinite_in_a_row=2",
                               f"trainer.output_dir={tmp_path}", "trainer.run_name=diverging"]
    with pytest.raises(SystemExit) as stopped:
        main(["train", *overrides])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "aligner-ext: error: 2 optimizer updates in a row had a non-finite loss" in error
    assert "Traceback" not in error
    run = tmp_path / "diverging"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r for r in records if "actor/num_updates" in r}
    assert trained[1]["actor/skipped_updates"] == 0 and trained[2]["actor/skipped_updates"] == 0
    assert trained[3]["actor/skipped_updates"] == 1 and trained[3]["actor/grad_norm"] is None  # NaN -> null
    assert 4 not in trained  # the second NaN update in a row stopped step 4 before it was logged
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_3"
    weights = load_file(str(checkpoints / "step_3" / "model.safetensors"))
    assert all(tensor.isfinite().all() for tensor in weights.values())

    monkeypatch.setattr(ClippedPGLoss, "__call__", honest)  # the cause fixed, the run resumes and finishes
    summary_code = main(["train", *overrides])
    assert summary_code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "actor/num_updates" in r] == [1, 2, 3, 4, 5, 6]
