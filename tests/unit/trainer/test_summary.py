"""The end-of-run summary shows accuracy in points and every other held-out metric before and after."""

from aligner_ext.trainer.loop import RunSummary
from aligner_ext.trainer.summary import print_summary


def test_summary_lists_every_held_out_metric(capsys):
    before = {"val/accuracy": 0.355, "val/reward_mean": 0.4, "val/ece": 0.455, "val/num_prompts": 200.0}
    after = {"val/accuracy": 0.605, "val/reward_mean": 0.6, "val/ece": 0.14, "val/num_prompts": 200.0}
    print_summary(RunSummary(run_dir="runs/x", steps=150, accuracy_before=0.355, accuracy_after=0.605,
                             reward_before=0.4, reward_after=0.6, train_seconds=88.0,
                             run_means={"dynamic_sampling/filtered_fraction": 0.099},
                             held_out_before=before, held_out_after=after))
    out = capsys.readouterr().out
    assert "35.5" in out and "60.5" in out and "+25.0 pts" in out
    assert "ece" in out and "0.455" in out and "0.140" in out and "-0.315" in out
    assert "num_prompts" not in out
    assert "run mean of dynamic_sampling/filtered_fraction: 0.099" in out


def test_a_run_without_validation_says_so_instead_of_nan(capsys):
    nan = float("nan")
    print_summary(RunSummary(run_dir="runs/x", steps=3, accuracy_before=nan, accuracy_after=nan, reward_before=nan,
                             reward_after=nan, train_seconds=1.0, run_means={}, held_out_before={}, held_out_after={}))
    out = capsys.readouterr().out
    assert "no validation set" in out and "nan" not in out


def test_the_progress_line_shows_reward_accuracy_step_time_and_held_out_accuracy():
    from aligner_ext.trainer.loop import progress_line

    line = progress_line({"reward/mean": 0.4375, "reward/accuracy": 0.4375, "timing/step_s": 1.26},
                         {"val/accuracy": 0.585})
    assert line == "reward 0.438, acc 44%, 1.3 s/step, val acc 58.5%"
    assert progress_line({"timing/step_s": 2.0, "reward/accuracy": float("nan")}, {}) == "2.0 s/step"


def test_an_undefined_held_out_metric_says_so(capsys):
    nan = float("nan")
    print_summary(RunSummary(run_dir="runs/x", steps=3, accuracy_before=0.25, accuracy_after=0.5, reward_before=0.1,
                             reward_after=0.2, train_seconds=1.0, run_means={},
                             held_out_before={"val/brier": nan}, held_out_after={"val/brier": 0.125}))
    out = capsys.readouterr().out
    assert "undefined" in out and "0.125" in out and "nan" not in out


def test_a_sampled_evaluation_is_named_with_pass_and_maj_rows_in_order(capsys):
    before = {"val/accuracy": 0.25, "val/reward_mean": 0.25, "val/pass_at_2": 0.4, "val/pass_at_16": 0.6,
              "val/maj_at_16": 0.3, "val/arith/pass_at_16": 0.7}
    after = {key: value + 0.1 for key, value in before.items()}
    print_summary(RunSummary(run_dir="runs/x", steps=3, accuracy_before=0.25, accuracy_after=0.35, reward_before=0.25,
                             reward_after=0.35, train_seconds=1.0, run_means={}, held_out_before=before,
                             held_out_after=after, evaluation="16 samples, temperature 0.7"))
    out = capsys.readouterr().out
    assert "held-out (16 samples, temperature 0.7)" in out
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.count("│") >= 4]
    assert rows[2:] == ["arith/pass@16", "maj@16", "pass@2", "pass@16"]


def test_the_fallback_share_and_each_warning_are_printed_on_one_line(capsys):
    warning = ("the policy could not learn in 3 of 3 steps, in stretches of 3 or more in a row (steps 1-3; "
               "trainer.no_learning_steps); likely cause: every reward was reward.fallback_score (the reward "
               "function raised or timed out on every call: see its warnings)")
    print_summary(RunSummary(run_dir="runs/x", steps=3, accuracy_before=0.25, accuracy_after=0.25, reward_before=0.0,
                             reward_after=0.0, train_seconds=1.0, run_means={}, held_out_before={},
                             held_out_after={}, reward_fallback_fraction=1.0, warnings=[warning, "second"]))
    lines = capsys.readouterr().out.splitlines()
    assert "rewards that fell back to reward.fallback_score (run mean of reward/fallback_fraction): 1.000" in lines
    assert f"warning: {warning}" in lines and "warning: second" in lines
