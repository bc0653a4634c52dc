"""Run logs: a jsonl metrics file, TensorBoard scalars, sample completions, and the end-of-run plot."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aligner_ext.batch import ExperienceBatch
from aligner_ext.distributed import is_main_process

logger = logging.getLogger(__name__)

# The end-of-run plot's panels, in order: (quantity, y-axis unit or "", training key, held-out key or None).
# A training series is drawn with its moving average, a held-out one with markers; the accuracy panel also
# shows the held-out pass@k and maj@k of a sampled evaluation (SAMPLED).
TRAIN_LABEL = "train (batch mean)"
PLOTTED = (
    ("reward", "", "reward/mean", "val/reward_mean"),
    ("accuracy", "", "reward/accuracy", "val/accuracy"),
    ("response length", "tokens", "response/length_mean", "val/response_length"),
    ("KL to the reference", "per token", "actor/kl", None),
    ("entropy", "nats per token", "actor/entropy", None),
)
SAMPLED = re.compile(r"val/(pass|maj)_at_(\d+)")
PANEL_COLUMNS = 3


class StageTimer:
    """Wall-clock seconds per named stage of a step: `with timer("rollout"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        timings = {f"timing/{stage}_s": value for stage, value in self.seconds.items()}
        timings["timing/step_s"] = sum(self.seconds.values())
        return timings


class MetricsLogger:
    """Appends one json line per step to `metrics.jsonl` and mirrors scalars to TensorBoard.
    In a multi-process run only the main process writes; the others' calls do nothing."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, start_step: int, trackers: Callable[[], list] = list):
        """`trackers` builds the experiment trackers (aligner_ext/trackers.py) on the main process only."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.enabled = is_main_process()
        self.writer = None
        self.trackers: list = []
        if not self.enabled:
            return
        self.trackers = trackers()
        self._truncate_after(start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Events after the checkpoint's step (all, for a fresh start) are purged: the run logs them again
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else 0)

    def _truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed checkpoint; all of them for a fresh start),
        so the log reads as one run. A line that does not parse (the last one, torn by a run killed
        mid-write) is dropped and counted in a warning."""
        for path in (self.path, self.samples_path):
            if path.exists() and step == 0:
                path.unlink()
            elif path.exists():
                kept, unreadable = [], 0
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        unreadable += 1
                        continue
                    if record["step"] <= step:
                        kept.append(line)
                if unreadable:
                    logger.warning("%s: dropped %d unreadable line(s) on resume", path, unreadable)
                # written beside and renamed over: a kill during the rewrite leaves the old file whole
                rewritten = path.with_name(path.name + ".tmp")
                rewritten.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
                os.replace(rewritten, path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{key: _finite(value) for key, value in sorted(metrics.items())}}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def log_samples(self, step: int, batch: ExperienceBatch, count: int) -> None:
        """Write `count` completions (prompt, response, reward) to samples.jsonl and the log."""
        if not self.enabled:
            return
        with open(self.samples_path, "a", encoding="utf-8") as handle:
            for index in range(min(count, len(batch))):
                sample = batch.samples[index]
                record = {
                    "step": step,
                    "row_id": sample.row.row_id,
                    "prompt": sample.row.messages[-1]["content"],
                    "response": sample.response_text,
                    "reward": float(batch.rewards[index]),
                    "finish_reason": sample.finish_reason,
                }
                handle.write(json.dumps(record) + "\n")
                logger.info("step %d sample %d: %r -> %r (reward %.3f)", step, index, record["prompt"],
                            record["response"], record["reward"])

    def close(self, files: tuple[Path, ...] = ()) -> None:
        """Close TensorBoard and the trackers, handing them `files` (the end-of-run plot) first."""
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            for path in files:
                tracker.log_file(path)
            tracker.close()


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_history(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_history(metrics_path: str | Path, png_path: str | Path, evaluation: str = "greedy") -> Path:
    """Write `history_figure(metrics_path, evaluation)` as a PNG at `png_path`."""
    figure = history_figure(metrics_path, evaluation)
    figure.savefig(png_path, dpi=100)
    return Path(png_path)


@dataclass
class Panel:
    """One quantity's axes: its series as (label, [(step, value)]), and the quantities it also shows."""

    quantity: str
    unit: str
    series: list[tuple[str, list[tuple[int, float]]]]
    same_as: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return " = ".join([self.quantity, *self.same_as])

    @property
    def ylabel(self) -> str:
        return f"{self.title} ({self.unit})" if self.unit else self.title


def history_panels(history: list[dict], evaluation: str = "greedy") -> list[Panel]:
    """The panels of PLOTTED that have data; `evaluation` says how the held-out responses were drawn
    (`EvalConfig.describe`). A panel whose every series repeats, point for point, the series of the same
    label in an earlier panel (the demo task's reward is its accuracy) is not drawn again: the earlier
    panel's title names both quantities."""
    panels: list[Panel] = []
    for quantity, unit, train_key, held_out_key in PLOTTED:
        keys = [(train_key, TRAIN_LABEL), (held_out_key, f"held-out ({evaluation})")]
        if quantity == "accuracy":
            keys += sampled_keys(history)
        series = [(label, points) for key, label in keys if key and (points := _points(history, key))]
        if not series:
            continue
        same = next((p for p in panels if _same_series(p.series, series)), None)
        if same is not None:
            same.same_as.append(quantity)
        else:
            panels.append(Panel(quantity, unit, series))
    return panels


def sampled_keys(history: list[dict]) -> list[tuple[str, str]]:
    """(key, label) of the held-out pass@k of the largest k logged and of maj@k, when the evaluation sampled."""
    logged: dict[str, set[int]] = {"pass": set(), "maj": set()}
    for record in history:
        for key in record:
            if match := SAMPLED.fullmatch(key):
                logged[match.group(1)].add(int(match.group(2)))
    return [(f"val/{kind}_at_{max(ks)}", f"held-out {kind}@{max(ks)}") for kind, ks in logged.items() if ks]


def figure_class():
    """matplotlib's Figure, imported with its font manager's warnings held back: the first import on a
    machine builds matplotlib's font cache and, past 5 s of it (a busy machine), warns that it is doing so,
    a line about matplotlib at the end of a run."""
    font_log = logging.getLogger("matplotlib.font_manager")
    level = font_log.level
    font_log.setLevel(logging.ERROR)
    try:
        from matplotlib.figure import Figure
    finally:
        font_log.setLevel(level)
    return Figure


def history_figure(metrics_path: str | Path, evaluation: str = "greedy"):
    """A matplotlib Figure of a run's metrics.jsonl: one panel per quantity of `history_panels`, step on
    x and the quantity on y, training values with a moving average and held-out evaluations as
    markers, one legend below the panels; titled with the run's directory name."""
    Figure = figure_class()
    metrics_path = Path(metrics_path)
    panels = history_panels(read_history(metrics_path), evaluation)
    columns = max(1, min(PANEL_COLUMNS, len(panels)))
    rows = max(1, math.ceil(len(panels) / columns))
    figure = Figure(figsize=(4.6 * columns, 3.9 * rows), layout="constrained")
    figure.suptitle(f"{metrics_path.parent.name}: training and held-out metrics per step")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    legend: dict[str, object] = {}  # label -> line, in order of first appearance
    held_out_colors: dict[str, str] = {}  # a held-out series keeps its colour in every panel
    for axis, panel in zip(axes, panels):
        for label, points in panel.series:
            if label == TRAIN_LABEL:
                _plot_series(axis, points, label, smooth=True, color="C0")
            else:
                color = held_out_colors.setdefault(label, f"C{1 + len(held_out_colors)}")
                _plot_series(axis, points, label, smooth=False, color=color)
        axis.set_title(panel.title)
        axis.set_xlabel("step")
        axis.set_ylabel(panel.ylabel)
        axis.grid(alpha=0.3)
        for line in axis.lines:
            legend.setdefault(line.get_label(), line)
    for axis in axes[len(panels):]:
        axis.set_axis_off()
    if legend:  # one legend for all panels (a series has the same style in each), below them, off the data
        figure.legend(list(legend.values()), list(legend), loc="outside lower center", ncol=len(legend),
                      frameon=False)
    else:
        axes[0].text(0.5, 0.5, "no metrics logged", ha="center", va="center", transform=axes[0].transAxes)
    return figure


def _points(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(record["step"], record[key]) for record in history if record.get(key) is not None]


def _same_series(a: list[tuple[str, list]], b: list[tuple[str, list]]) -> bool:
    """Whether two panels' series are the same labels with the same points (to float rounding)."""
    return [label for label, _ in a] == [label for label, _ in b] and all(
        len(x) == len(y) and all(sx == sy and math.isclose(vx, vy, rel_tol=1e-9, abs_tol=1e-12)
                                 for (sx, vx), (sy, vy) in zip(x, y))
        for (_, x), (_, y) in zip(a, b))


def _plot_series(axis, points: list[tuple[int, float]], label: str, smooth: bool, color: str) -> None:
    """Held-out values as markers; training values as a line, with a moving average over 1/15 of the
    steps once that is more than one step."""
    steps, values = zip(*points)
    window = max(1, len(values) // 15)
    if not smooth or window == 1:  # a moving average of 1 would draw the same curve twice
        axis.plot(steps, values, color=color, marker=None if smooth else "o", markersize=4, label=label)
        return
    axis.plot(steps, values, color=color, alpha=0.3, label=label)
    averaged = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))]
    axis.plot(steps, averaged, color=color, label=f"{label}, moving average of {window}")
