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
