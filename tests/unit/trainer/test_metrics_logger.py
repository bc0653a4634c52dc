"""MetricsLogger (jsonl lines, NaN as null, truncation on resume), log_samples, plot_history, StageTimer."""

import json
import logging
import math
import warnings

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptRow
from aligner_ext.trainer.metrics import MetricsLogger, StageTimer, plot_history, read_history

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def strict_json(line):
    """json.loads that rejects the non-standard NaN / Infinity tokens."""
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=reject)


def lines(path):
    return [strict_json(line) for line in path.read_text().splitlines()]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_log_appends_one_line_per_call_with_nan_and_inf_as_null(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, start_step=0)
    log.log(1, {"loss": 0.5, "reward/mean": 1})
    log.log(2, {"loss": math.nan, "grad_norm": math.inf, "kl": -math.inf, "reward/mean": 0.25})
    log.close()
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5, "reward/mean": 1.0},
        {"step": 2, "loss": None, "grad_norm": None, "kl": None, "reward/mean": 0.25},
    ]


def test_resume_drops_records_after_the_checkpoint_step(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "loss": float(s)} for s in range(5)])
    write_jsonl(tmp_path / "samples.jsonl", [{"step": s, "row_id": f"r{i}"} for s in (2, 4) for i in range(2)])
    log = MetricsLogger(tmp_path, tensorboard=False, start_step=2)
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert lines(tmp_path / "samples.jsonl") == [{"step": 2, "row_id": "r0"}, {"step": 2, "row_id": "r1"}]
    log.log(3, {"loss": 3.5})  # the resumed run continues the same file
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert lines(tmp_path / "metrics.jsonl")[-1] == {"step": 3, "loss": 3.5}


def test_resume_drops_a_line_torn_by_a_killed_run_and_says_so(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="aligner_ext.trainer.metrics"):
        MetricsLogger(tmp_path, tensorboard=False, start_step=2)
    assert lines(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0] and "1 unreadable line" in warnings[0]


def tensorboard_steps(run_dir, key):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [event.step for event in events.Scalars(key)]


def test_a_resume_purges_the_tensorboard_points_it_logs_again(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=True, start_step=0)
    for step in range(5):  # the run reaches step 4, its checkpoint is step 2
        log.log(step, {"loss": float(step)})
    log.close()
    resumed = MetricsLogger(tmp_path, tensorboard=True, start_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 + step})
    resumed.close()
    assert tensorboard_steps(tmp_path, "loss") == [0, 1, 2, 3, 4]  # one point per step, not 3 and 4 twice


def test_the_resume_rewrite_is_atomic(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "loss": float(s)} for s in range(5)])
    original = (tmp_path / "metrics.jsonl").read_text()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies between writing the new file and renaming it

    monkeypatch.setattr("aligner_ext.trainer.metrics.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLogger(tmp_path, tensorboard=False, start_step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == original  # the history is whole


def test_fresh_start_removes_old_logs(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": s} for s in range(3)])
    write_jsonl(tmp_path / "samples.jsonl", [{"step": 1}])
    log = MetricsLogger(tmp_path, tensorboard=False, start_step=0)
    assert not (tmp_path / "samples.jsonl").exists()
    log.log(0, {"val/accuracy": 0.5})
    assert lines(tmp_path / "metrics.jsonl") == [{"step": 0, "val/accuracy": 0.5}]


def test_log_samples_writes_count_records(tmp_path):
    rows = [PromptRow(row_id=f"t:{i}", messages=[{"role": "user", "content": f"q{i}"}], data_source="t")
            for i in range(3)]
    batch = ExperienceBatch(
        prompt_ids=torch.ones(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.bool),
        response_ids=torch.ones(3, 2, dtype=torch.long), response_valid=torch.ones(3, 2, dtype=torch.bool),
        response_mask=torch.ones(3, 2, dtype=torch.bool), group_ids=torch.arange(3),
        samples=[SampleInfo(row=row, response_text=f"a{i}", finish_reason="eos") for i, row in enumerate(rows)],
        rewards=torch.tensor([1.0, 0.0, 0.5]),
    )
    log = MetricsLogger(tmp_path, tensorboard=False, start_step=0)
    log.log_samples(4, batch, count=2)
    log.log_samples(5, batch, count=10)  # more than the batch holds: all of it
    records = lines(tmp_path / "samples.jsonl")
    assert [(r["step"], r["row_id"]) for r in records] == [(4, "t:0"), (4, "t:1"), (5, "t:0"), (5, "t:1"), (5, "t:2")]
    assert records[1] == {"step": 4, "row_id": "t:1", "prompt": "q1", "response": "a1", "reward": 0.0,
                          "finish_reason": "eos"}


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000  # axes, ticks and lines, not an empty image


def test_plot_history_writes_a_png_when_some_keys_are_absent(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, start_step=0)
    log.log(0, {"val/accuracy": 0.25})
    log.log(1, {"reward/mean": 0.1})  # no reward/accuracy at all; val/accuracy only at steps 0 and 3
    log.log(2, {"reward/mean": math.nan})
    log.log(3, {"reward/mean": 0.3, "val/accuracy": 0.5})
    history = read_history(tmp_path / "metrics.jsonl")
    assert [(r.get("reward/mean"), r.get("val/accuracy")) for r in history] == [
        (None, 0.25), (0.1, None), (None, None), (0.3, 0.5)]
    png = plot_history(tmp_path / "metrics.jsonl", tmp_path / "plot.png")
    assert png == tmp_path / "plot.png"
    assert_png(png)


def test_plot_history_without_any_plotted_key_still_writes_a_png(tmp_path):
    MetricsLogger(tmp_path, tensorboard=False, start_step=0).log(1, {"loss": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's warning about a legend with no lines
        assert_png(plot_history(tmp_path / "metrics.jsonl", tmp_path / "plot.png"))


def test_stage_timer_sums_stages_into_step_seconds():
    timer = StageTimer()
    with timer("rollout"):
        sum(range(1000))
    with timer("train"):
        sum(range(1000))
    with timer("rollout"):  # a stage entered twice accumulates into one key
        sum(range(1000))
    timings = timer.metrics()
    assert set(timings) == {"timing/rollout_s", "timing/train_s", "timing/step_s"}
    assert all(value >= 0 for value in timings.values())
    assert timings["timing/step_s"] == pytest.approx(timings["timing/rollout_s"] + timings["timing/train_s"])
