"""Run logs: a jsonl metrics file, TensorBoard scalars, sample completions, and the end-of-run plot."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from aligner_ext.batch import ExperienceBatch
from aligner_ext.distributed import is_main_process

logger = logging.getLogger(__name__)

# (panel title, training metric, held-out metric)
PLOTTED = (("reward", "reward/mean", "val/reward_mean"), ("accuracy", "reward/accuracy", "val/accuracy"))


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


def plot_history(metrics_path: str | Path, png_path: str | Path) -> Path:
    """A PNG of reward (left) and accuracy (right) per step: training values with a moving average,
    held-out evaluations as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = read_history(metrics_path)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (title, train_key, val_key) in zip(axes, PLOTTED):
        _plot_series(axis, history, train_key, "train (batch)", smooth=True)
        _plot_series(axis, history, val_key, "held-out (greedy)", smooth=False)
        axis.set_xlabel("step")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend()
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return Path(png_path)


def _plot_series(axis, history: list[dict], key: str, label: str, smooth: bool) -> None:
    points = [(r["step"], r[key]) for r in history if r.get(key) is not None]
    if not points:
        return
    steps, values = zip(*points)
    if not smooth:
        axis.plot(steps, values, marker="o", label=label)
        return
    line = axis.plot(steps, values, alpha=0.3, label=label)[0]
    window = max(1, len(values) // 15)
    averaged = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))]
    axis.plot(steps, averaged, color=line.get_color(), label=f"{label}, moving average of {window}")
