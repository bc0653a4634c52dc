"""The no-learning detector (trainer/no_learning.py) fed the step metrics the runs that cannot learn log:
k steps in a row warn once, naming the causes the metrics tell apart; a healthy run, or fewer than k
steps without signal, never warn; identical samples under sampling warn at once."""

import logging

import pytest

from aligner_ext.trainer.no_learning import (AGREEING, CAUSES, CONSTANT, FALLBACKS, IDENTICAL, NO_BATCH, SKIPPED,
                                             ZERO_ADVANTAGE, ZERO_GRADIENT, ZERO_LR, NoLearningDetector, run_warnings)

# One step of a run that learns: the keys both policy backends and the batch metrics log.
HEALTHY = {"actor/num_updates": 1.0, "actor/grad_norm": 0.5, "actor/lr": 1e-6, "advantage/min": -1.5,
           "advantage/max": 1.2, "batch/num_samples": 16.0, "reward/std": 0.14, "reward/zero_std_group_fraction": 0.0,
           "reward/fallback_fraction": 0.0, "rollout/identical_group_fraction": 0.0}
# Every group's rewards agree: advantages 0 and, without a KL term, the gradient 0 too.
NO_SIGNAL = {**HEALTHY, "actor/grad_norm": 0.0, "advantage/min": 0.0, "advantage/max": 0.0,
             "reward/zero_std_group_fraction": 1.0}
CONSTANT_REWARD = {**NO_SIGNAL, "reward/std": 0.0}  # also empty ground truths or prompts under an exact match

CASES = {
    "policy.optim.lr=0 (the rewards still vary)": ({**HEALTHY, "actor/lr": 0.0}, ZERO_LR),
    "a reward that returns one value": (CONSTANT_REWARD, CONSTANT),
    "rollout.temperature=1e-5": ({**CONSTANT_REWARD, "rollout/identical_group_fraction": 1.0},
                                 IDENTICAL.format(temperature=1.0)),
    "a reward that always raises": ({**CONSTANT_REWARD, "reward/fallback_fraction": 1.0}, FALLBACKS),
    "groups that agree, each its own way": ({**NO_SIGNAL, "reward/std": 0.4}, AGREEING),
    "dynamic sampling gave up: no batch": ({"reward/fallback_fraction": 0.0, "actor/lr": None}, NO_BATCH),
    "every update skipped": ({**HEALTHY, "actor/num_updates": 0.0, "actor/grad_norm": None}, SKIPPED),
    "advantages zeroed although rewards spread": ({**HEALTHY, "advantage/min": 0.0, "advantage/max": 0.0},
                                                  ZERO_ADVANTAGE),
    "a zero gradient with advantages": ({**HEALTHY, "actor/grad_norm": 0.0}, ZERO_GRADIENT),
}


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "aligner_ext.trainer.no_learning"]


def named_causes(line: str) -> list[str]:
    """The causes a line names, IDENTICAL's at temperature 1.0 (every detector here samples at 1.0 but one)."""
    return [cause.format(temperature=1.0) for cause in CAUSES if cause.format(temperature=1.0) in line]


@pytest.mark.parametrize("case", CASES)
def test_k_steps_in_a_row_warn_once_naming_the_cause(case, caplog):
    metrics, cause = CASES[case]
    detector = NoLearningDetector(3, temperature=1.0)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2):
            detector.observe(step, metrics)
        identical_warnings = warnings_of(caplog)
        assert all(line.startswith("step 1: every group's samples were token-identical") for line in identical_warnings)
        assert len(identical_warnings) == (cause == IDENTICAL.format(temperature=1.0))  # that one warns at once
        detector.observe(3, metrics)
        detector.observe(4, metrics)  # the stretch goes on: no second warning
    lines = warnings_of(caplog)[len(identical_warnings):]
    assert len(lines) == 1
    assert lines[0].startswith("steps 1-3: the policy could not learn for 3 steps in a row (trainer.no_learning_steps=3); "
                               "likely cause: ")
    assert named_causes(lines[0]) == [cause]
    summary = detector.findings()[0]
    assert summary.startswith("the policy could not learn in 4 of 4 steps, in stretches of 3 or more in a row "
                              "(steps 1-4;")
    assert named_causes(summary) == [cause]


def test_a_healthy_run_and_short_stretches_never_warn(caplog):
    """Two steps in a row without signal (every group right, say) are ordinary at k=3."""
    detector = NoLearningDetector(3, temperature=1.0)
    steps = [HEALTHY, NO_SIGNAL, NO_SIGNAL, HEALTHY, CONSTANT_REWARD, {**HEALTHY, "actor/lr": 0.0}, HEALTHY]
    with caplog.at_level(logging.WARNING):
        for step, metrics in enumerate(steps, start=1):
            detector.observe(step, metrics)
    assert warnings_of(caplog) == [] and detector.findings() == []


def test_a_new_stretch_warns_again_and_the_summary_covers_the_run(caplog):
    detector = NoLearningDetector(2, temperature=1.0)
    steps = [CONSTANT_REWARD, CONSTANT_REWARD, HEALTHY, CONSTANT_REWARD, HEALTHY,
             {**HEALTHY, "reward/fallback_fraction": 1.0, "advantage/min": 0.0, "advantage/max": 0.0}] + [
        {**CONSTANT_REWARD, "reward/fallback_fraction": 1.0}] * 3
    with caplog.at_level(logging.WARNING):
        for step, metrics in enumerate(steps, start=1):
            detector.observe(step, metrics)
    lines = warnings_of(caplog)
    assert [line.split(":")[0] for line in lines] == ["steps 1-2", "steps 6-7"]
    # stretches 1-2 and 6-9 count (2 + 4 steps of 9); step 4 alone is shorter than k
    summary, = detector.findings()
    assert summary.startswith("the policy could not learn in 6 of 9 steps, in stretches of 2 or more in a row "
                              "(steps 1-2, 6-9;")
    assert named_causes(summary) == [FALLBACKS, CONSTANT]


def test_the_summary_names_five_stretches_and_counts_the_rest():
    detector = NoLearningDetector(1, temperature=1.0)
    for step in range(1, 15):
        detector.observe(step, CONSTANT_REWARD if step % 2 else HEALTHY)  # 7 stretches: steps 1, 3, ..., 13
    assert "(steps 1, 3, 5, 7, 9 and 2 more;" in detector.findings()[0]


def test_the_update_ran_at_the_rate_the_previous_step_reported(caplog):
    """`actor/lr` is logged after the schedule's step: a cosine decay to 0 reports 0 after its last update,
    which ran at the previous rate; the step after a reported 0 did run at 0."""
    decaying = [{**HEALTHY, "actor/lr": rate} for rate in (1e-6, 5e-7, 0.0)]
    detector = NoLearningDetector(1, temperature=1.0)
    with caplog.at_level(logging.WARNING):
        for step, metrics in enumerate(decaying, start=1):
            detector.observe(step, metrics)
        assert warnings_of(caplog) == []
        detector.observe(4, {**HEALTHY, "actor/lr": 0.0})
    assert warnings_of(caplog) == ["step 4: the policy could not learn for 1 step in a row "
                                   f"(trainer.no_learning_steps=1); likely cause: {ZERO_LR}"]
    detector = NoLearningDetector(1, temperature=1.0)
    detector.observe(1, {**HEALTHY, "actor/lr": 0.0})  # the first step watched: its own report
    detector.observe(2, {"reward/fallback_fraction": 0.0})  # an empty batch: no report, the rate stays 0
    detector.observe(3, HEALTHY)
    assert "(steps 1-3;" in detector.findings()[0]


def test_identical_samples_warn_at_once_and_again_after_a_step_without(caplog):
    identical = {**HEALTHY, "rollout/identical_group_fraction": 1.0}
    detector = NoLearningDetector(3, temperature=0.7)
    with caplog.at_level(logging.WARNING):
        for step, metrics in enumerate([identical, identical, HEALTHY, identical,
                                        {**HEALTHY, "rollout/identical_group_fraction": 0.75}], start=1):
            detector.observe(step, metrics)
    lines = warnings_of(caplog)
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 4"]
    assert "rollout.temperature=0.7 samples" in lines[0]
    assert detector.findings() == [f"{IDENTICAL.format(temperature=0.7)} at 3 of 5 steps (first: step 1)"]
    greedy = NoLearningDetector(3, temperature=0.0)  # greedy decoding gives identical samples by design
    greedy.observe(1, identical)
    assert greedy.findings() == []


def test_the_summary_replays_metrics_jsonl_records():
    """Step 0 holds the evaluation before training; NaN was written as null."""
    history = [{"step": 0, "val/accuracy": 0.5}] + [
        {"step": step, **CONSTANT_REWARD, "reward/fallback_fraction": 1.0, "actor/update_ratio_max": None}
        for step in (1, 2, 3)]
    summary, = run_warnings(history, steps_in_a_row=3, temperature=1.0)
    assert summary.startswith("the policy could not learn in 3 of 3 steps") and named_causes(summary) == [FALLBACKS]
    assert run_warnings(history[:3], steps_in_a_row=3, temperature=1.0) == []
