"""The run summary printed at the end of training."""

from __future__ import annotations

import math
import re

from rich.console import Console
from rich.table import Table

from aligner_ext.trainer.loop import RunSummary


def _name(key: str) -> str:
    """A held-out metric's row name: `val/pass_at_8` -> `pass@8` (keys spell @ as _at_ for MLflow)."""
    return re.sub(r"_at_(\d+)$", r"@\1", key.removeprefix("val/"))


def _in_number_order(key: str) -> list:
    """Sort key putting pass@2 before pass@16."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _value(number: float) -> str:
    """A held-out metric; NaN is a metric undefined at that evaluation (e.g. calibration with no confidence)."""
    return "undefined" if math.isnan(number) else f"{number:.3f}"


def print_summary(summary: RunSummary) -> None:
    table = Table(title=f"Run summary ({summary.steps} steps, {summary.train_seconds:.0f} s of RL)")
    table.add_column(f"held-out ({summary.evaluation})")
    table.add_column("before RL", justify="right")
    table.add_column("after RL", justify="right")
    table.add_column("change", justify="right")
    for name, before, after, scale in (
        ("accuracy", summary.accuracy_before, summary.accuracy_after, 100.0),
        ("mean reward", summary.reward_before, summary.reward_after, 1.0),
    ):
        if math.isnan(before) and math.isnan(after):  # nothing was evaluated
            table.add_row(name, "no validation set", "no validation set", "")
            continue
        unit = " pts" if scale == 100.0 else ""
        table.add_row(name, f"{before * scale:.1f}", f"{after * scale:.1f}", f"{(after - before) * scale:+.1f}{unit}")
    held_out = set(summary.held_out_before) & set(summary.held_out_after) - {"val/accuracy", "val/reward_mean"}
    for key in sorted((key for key in held_out if not key.endswith("num_prompts")), key=_in_number_order):
        before, after = summary.held_out_before[key], summary.held_out_after[key]
        if before is not None and after is not None:
            change = after - before
            table.add_row(_name(key), _value(before), _value(after),
                          "" if math.isnan(change) else f"{change:+.3f}")
    console = Console()
    console.print(table)
    for key, value in summary.run_means.items():
        console.print(f"run mean of {key}: {value:.3f}")
    if not math.isnan(summary.reward_fallback_fraction):
        console.print(f"rewards that fell back to reward.fallback_score (run mean of reward/fallback_fraction): "
                      f"{summary.reward_fallback_fraction:.3f}", soft_wrap=True)
    for warning in summary.warnings:  # one line each, unwrapped, so that it reads as the log's
        console.print(f"warning: {warning}", style="bold yellow", markup=False, soft_wrap=True)
    console.print(f"run directory: {summary.run_dir} (metrics.jsonl, reward_accuracy.png, hf_model/, checkpoints/)")
