"""What a run says when it starts: where it writes and whether it resumed, how much data each split
has and whether a step repeats rows, how long the prompts are, which reward scores each data_source,
which data_sources have no majority vote in a sampled evaluation, and how stale generation ahead of
training may be."""

from __future__ import annotations

import math
from pathlib import Path

from aligner_ext.config import RunConfig
from aligner_ext.experience.base import EXPERIENCE_MAKERS
from aligner_ext.losses.settings import correction_mode
from aligner_ext.trainer.build import Components


def percentile(sorted_values: list[int], share: float) -> int:
    """The nearest-rank percentile of non-empty sorted values."""
    return sorted_values[max(0, math.ceil(share * len(sorted_values)) - 1)]


def startup_lines(cfg: RunConfig, parts: Components, run_dir: Path, start: str) -> list[str]:
    lines = [f"run directory {run_dir}: {start}"]
    several = len(parts.val_loaders) > 1
    splits = [("train", parts.train_loader)] + [(f"validation set {name}" if several else "validation", loader)
                                                for name, loader in parts.val_loaders.items()]
    for split, loader in splits:
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
    if not parts.val_loaders:
        lines.append("validation: no validation set (no held-out evaluation)")
    val_rows = [row for loader in parts.val_loaders.values() for row in loader.rows]
    rows = parts.train_loader.rows + val_rows
    scored = EXPERIENCE_MAKERS.get(cfg.algorithm.experience_maker).rows_scored_by_rewards(cfg, rows)
    names = parts.rewards.reward_names(scored)
    names.update({row.data_source: "its environment's score" for row in rows if row.data_source not in names})
    lines.append(f"rewards by data_source: {', '.join(f'{source} -> {name}' for source, name in sorted(names.items()))}")
    k = cfg.trainer.eval.k
    voting = {id(row) for row in scored}  # rows an environment scores have no reward function to ask
    unvoted = sorted({row.data_source for row in val_rows if id(row) in voting and not parts.rewards.extracts_answer(row)}
                     ) if k > 1 else []
    if unvoted:
        lines.append(f"maj@{k} is not reported for data_source {', '.join(unvoted)}: its reward extracts no answer "
                     "(RewardResult.answer, docs/rewards.md)")
    lines += generation_ahead_lines(cfg)
    return lines


def generation_ahead_lines(cfg: RunConfig) -> list[str]:
    """With `trainer.asynchronous` on: its bound, where it generates, and the correction a stale batch wants when
    none is set."""
    ahead = cfg.trainer.asynchronous
    if not ahead.enabled:
        return []
    where = ("on the generation servers" if cfg.generator.engine == "remote" else
             "on a copy of the generation model" + (f" on {ahead.device}" if ahead.device else ""))
    line = (f"generation ahead of training (trainer.asynchronous): each batch at most {ahead.max_staleness} policy "
            f"version(s) behind the one it trains at, generated {where}")
    if ahead.max_staleness and correction_mode(cfg.loss) == "none":
        line += ("; loss.off_policy_correction=none leaves the behaviour policy's ratio out of the loss: "
                 "loss.importance_sampling_cap=2 gives the decoupled objective (docs/async.md)")
    return [line]
