"""The end-of-run plot: one labelled panel per distinct quantity in metrics.jsonl, a title naming the
run, the legend off the data, and one panel where two quantities are the same curve."""

import json
import warnings

import pytest

from aligner_ext.trainer.metrics import history_figure, plot_history


def write_history(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def step_record(step, accuracy, reward=None, **more):
    record = {"step": step, "reward/accuracy": accuracy, "reward/mean": accuracy if reward is None else reward,
              "response/length_mean": 20.0 + step, "actor/entropy": 3.0 - 0.1 * step, **more}
    if step % 2 == 0:
        record.update({"val/accuracy": accuracy / 2, "val/reward_mean": (accuracy if reward is None else reward) / 2,
                       "val/response_length": 18.0})
    return record


def panels(figure):
    """(title, x label, y label) of each drawn panel, in order."""
    return [(axis.get_title(), axis.get_xlabel(), axis.get_ylabel()) for axis in figure.axes if axis.axison]


def test_distinct_quantities_get_labelled_panels_and_a_titled_figure(tmp_path):
    records = [step_record(s, 0.1 * s, reward=0.05 * s + 0.3, **{"actor/kl": 0.01 * s}) for s in range(1, 7)]
    path = write_history(tmp_path / "gsm8k_grpo", records)
    figure = history_figure(path)
    assert figure.get_suptitle().startswith("gsm8k_grpo")
    assert panels(figure) == [
        ("reward", "step", "reward"),
        ("accuracy", "step", "accuracy"),
        ("response length", "step", "response length (tokens)"),
        ("KL to the reference", "step", "KL to the reference (per token)"),
        ("entropy", "step", "entropy (nats per token)"),
    ]
    reward_axis = figure.axes[0]
    drawn = {line.get_label(): list(line.get_ydata()) for line in reward_axis.lines}
    assert drawn["train (batch mean)"] == pytest.approx([0.05 * s + 0.3 for s in range(1, 7)])
    assert drawn["held-out (greedy)"] == pytest.approx([(0.05 * s + 0.3) / 2 for s in (2, 4, 6)])
    # no legend inside a panel; one for the figure, below the panels
    assert all(axis.get_legend() is None for axis in figure.axes)
    (legend,) = figure.legends
    figure.draw_without_rendering()  # runs the layout
    assert [text.get_text() for text in legend.get_texts()] == ["train (batch mean)", "held-out (greedy)"]
    assert legend.get_window_extent().y1 <= min(axis.get_window_extent().y0 for axis in figure.axes if axis.axison)


def test_identical_reward_and_accuracy_share_one_panel(tmp_path):
    path = write_history(tmp_path / "demo", [step_record(s, 0.1 * s) for s in range(1, 5)])
    figure = history_figure(path)
    assert panels(figure) == [
        ("reward = accuracy", "step", "reward = accuracy"),
        ("response length", "step", "response length (tokens)"),
        ("entropy", "step", "entropy (nats per token)"),
    ]


def test_reward_differing_only_held_out_keeps_two_panels(tmp_path):
    records = [step_record(s, 0.1 * s) for s in range(1, 5)]
    records[1]["val/reward_mean"] += 0.5  # the training curves agree, the held-out ones do not
    titles = [title for title, _, _ in panels(history_figure(write_history(tmp_path / "run", records)))]
    assert titles[:2] == ["reward", "accuracy"]


def test_many_steps_draw_a_moving_average_and_a_short_run_does_not(tmp_path):
    records = [{"step": s, "reward/mean": float(s % 3)} for s in range(1, 46)]  # window 45 // 15 = 3
    axis = history_figure(write_history(tmp_path / "long", records)).axes[0]
    averaged = [line for line in axis.lines if "moving average of 3" in line.get_label()]
    assert len(averaged) == 1 and averaged[0].get_ydata()[5] == pytest.approx((0 + 1 + 2) / 3)
    short = history_figure(write_history(tmp_path / "short", records[:10])).axes[0]
    assert len(short.lines) == 1  # a moving average of 1 step would repeat the curve


def test_plot_history_writes_the_png(tmp_path):
    path = write_history(tmp_path / "run", [step_record(s, 0.1 * s) for s in range(1, 4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plot_history(path, tmp_path / "run" / "reward_accuracy.png")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_sampled_evaluation_adds_pass_and_maj_to_the_accuracy_panel(tmp_path):
    records = [step_record(s, 0.1 * s, reward=0.5) for s in range(1, 5)]
    for record in records[1::2]:  # the held-out steps
        record.update({"val/pass_at_1": 0.2, "val/pass_at_2": 0.3, "val/pass_at_4": 0.5, "val/maj_at_4": 0.25})
    figure = history_figure(write_history(tmp_path / "run", records), "4 samples, temperature 1")
    drawn = {line.get_label(): (list(line.get_ydata()), line.get_color()) for line in figure.axes[1].lines}
    assert list(drawn) == ["train (batch mean)", "held-out (4 samples, temperature 1)", "held-out pass@4",
                           "held-out maj@4"]
    assert drawn["held-out pass@4"][0] == [0.5, 0.5] and drawn["held-out maj@4"][0] == [0.25, 0.25]
    assert len({color for _, color in drawn.values()}) == 4
    reward_labels = [line.get_label() for line in figure.axes[0].lines]  # held-out keeps its colour there
    assert reward_labels == ["train (batch mean)", "held-out (4 samples, temperature 1)"]
    assert figure.axes[0].lines[1].get_color() == drawn["held-out (4 samples, temperature 1)"][1]
