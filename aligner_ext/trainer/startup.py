"""What a run says when it starts: where it writes and whether it resumed, how much data each split
has and whether a step repeats rows, how long the prompts are, and which reward scores each data_source."""

from __future__ import annotations

import math
from pathlib import Path

from aligner_ext.config import RunConfig
from aligner_ext.trainer.build import Components


def percentile(sorted_values: list[int], share: float) -> int:
    """The nearest-rank percentile of non-empty sorted values."""
    return sorted_values[max(0, math.ceil(share * len(sorted_values)) - 1)]


def startup_lines(cfg: RunConfig, parts: Components, run_dir: Path, start: str) -> list[str]:
    lines = [f"run directory {run_dir}: {start}"]
    for split, loader in (("train", parts.train_loader), ("validation", parts.val_loader)):
        if loader is None:
            lines.append("validation: no validation set (no held-out evaluation)")
            continue
        lengths = sorted(loader.prompt_lengths)
        line = (f"{split}: {len(loader)} rows; prompt tokens p50 {percentile(lengths, 0.5)}, p90 "
                f"{percentile(lengths, 0.9)}, max {lengths[-1]} (data.max_prompt_length={cfg.data.max_prompt_length})")
        dropped = loader.num_skipped_overlong + loader.num_truncated_overlong
        if dropped:
            line += f"; {loader.num_skipped_overlong} skipped and {loader.num_truncated_overlong} truncated as overlong"
        if split == "train" and len(loader) < loader.batch_size:
            line += (f"; fewer rows than a batch of {loader.batch_size} (data.train_batch_size): every step repeats "
                     "rows")
        lines.append(line)
    rows = parts.train_loader.rows + (parts.val_loader.rows if parts.val_loader is not None else [])
    rewards = ", ".join(f"{source} -> {name}" for source, name in sorted(parts.rewards.reward_names(rows).items()))
    lines.append(f"rewards by data_source: {rewards}")
    return lines
