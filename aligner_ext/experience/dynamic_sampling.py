"""Dynamic sampling (DAPO): drop prompt groups whose outcomes all agree, refill until the batch is full.

A group whose samples all got the same outcome (all correct or all wrong) has zero advantage
everywhere under GRPO, so it costs compute and contributes nothing but a smaller effective batch.
DAPO (Yu et al. 2025, arXiv 2503.14476) drops such groups and keeps generating until
`data.train_batch_size` groups with mixed outcomes are collected; this wrapper does that around any
experience maker:

    kept = surplus carried from earlier steps (optional)
    while len(kept) < target:
        missing = target - len(kept)
        batch = inner.make_experience(next ceil(missing * oversample) prompts)   # refill what is missing
        kept += groups of batch the filter keeps (by default: outcome spread max - min > eps)
    train on the oldest `target` groups; carry or discard the rest (whole groups)

Decisions (docs/variants/dapo.md; tests/unit/experience/test_dynamic_sampling.py pins them):
- The filter is a predicate per group (by group id) returning keep and a reason, counted into
  metrics (experience/filters.py). Single-round batches are judged on the raw outcome before any
  shaping: `correct` by default, or the sequence sum of the token-level scores (`filter_metric:
  seq_reward`, the original recipe's metric). MTPO's two-round batches are judged per segment (`segments`:
  kept when the answers' or one answer's confidences' rewards spread); with MTPO on, the default
  `correct` is read as `segments` (variants.py).
- Every generation batch asks only for the missing groups (times `oversample`, 1.0 by default), so
  with the default nothing valid is generated beyond the target. With `oversample` > 1 there are
  fewer generation rounds and some valid surplus: carried to later steps when `keep_surplus` is on
  (each group at most `max_surplus_age` steps after it was sampled, since an older policy sampled
  it), else discarded and counted. The carried groups are saved in checkpoints.
- When `dynamic_sampling.max_gen_batches` is reached, `on_max_gen_batches` decides:
  `train_on_kept` (the original recipe's behaviour: a smaller batch this step) or `error`.
- The prompt stream is endless and crosses epoch boundaries, so exhausting the data mid-accumulation
  simply starts the next epoch (`data/epoch` shows it).
- If every group is filtered and the bound is hit, the step's batch is empty: the loop logs the
  step and makes no update.
- With groups carried over (`rollout.carry_over`) each refill is one call of the carrying maker, which takes
  the groups the refill asks for and carries the rest to the next call (experience/carry_over.py).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

from aligner_ext.batch import ExperienceBatch, concat_batches
from aligner_ext.context import BuildContext
from aligner_ext.errors import UserError
from aligner_ext.data.loader import PromptLoader
from aligner_ext.experience.base import EXPERIENCE_WRAPPERS, ExperienceMaker, ExperienceWrapper
from aligner_ext.experience.filters import FILTERS
from aligner_ext.experience.settings import DynamicSamplingConfig

logger = logging.getLogger(__name__)



class _PromptQuota:
    """A view of the prompt loader whose batches hold `count` prompts (the refill size)."""

    def __init__(self, loader: PromptLoader, count: int):
        self._loader = loader
        self.batch_size = count

    def next_batch(self, count: int | None = None):
        return self._loader.next_batch(self.batch_size if count is None else count)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class SamplingBoundReached(UserError, RuntimeError):
    """`dynamic_sampling.on_max_gen_batches=error`: a step's generation batches gave too few mixed groups."""


@EXPERIENCE_WRAPPERS.register("dynamic_sampling")
class DynamicSampling(ExperienceWrapper):
    """Wraps an experience maker; returns batches of exactly `target` groups with mixed outcomes."""

    Config = DynamicSamplingConfig

    def __init__(self, inner: ExperienceMaker, cfg: DynamicSamplingConfig, pad_token_id: int):
        super().__init__(inner)
        self.summary_metrics = inner.summary_metrics + (
            "dynamic_sampling/filtered_fraction", "dynamic_sampling/num_gen_batches")
        self.cfg = cfg
        self.filter = FILTERS[cfg.filter_metric]
        self.reads = self.filter.reads
        self.max_gen_batches = cfg.max_gen_batches
        self.pad_token_id = pad_token_id
        self.surplus: ExperienceBatch | None = None  # valid groups carried to the next step
        self.born: dict[int, int] = {}  # group id -> the step that sampled it, for the carried groups

    @classmethod
    def from_context(cls, inner: ExperienceMaker, ctx: BuildContext) -> ExperienceMaker:
        """The wrapper when `dynamic_sampling.enabled` is on; otherwise `inner` untouched."""
        if not ctx.cfg.dynamic_sampling.enabled:
            return inner
        return cls(inner, ctx.cfg.dynamic_sampling, ctx.tokenizer.pad_token_id)

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        target = loader.batch_size
        stats: dict[str, float] = defaultdict(float)
        kept = self._take_surplus(step, stats)
        inner_metrics: list[dict[str, float]] = []
        num_kept = _num_groups(kept)
        while num_kept < target:
            if self.max_gen_batches and stats["num_gen_batches"] >= self.max_gen_batches:
                self._bound_reached(step, num_kept, target)
                break
            request = math.ceil((target - num_kept) * self.cfg.oversample)
            batch, metrics = self.inner.make_experience(_PromptQuota(loader, request), step)
            inner_metrics.append(metrics)
            stats["num_gen_batches"] += 1
            kept_part = self._filter(batch, stats)
            kept.append(kept_part)
            num_kept += _num_groups([kept_part])
            logger.info("[Dynamic Sampling] Step %d, Gen batch %d: Kept %d/%d prompts, Accumulated: %d/%d",
                        step, int(stats["num_gen_batches"]), _num_groups([kept_part]), _num_groups([batch]),
                        num_kept, target)
        result = self._truncate(kept, target, step, stats)
        metrics = _merge_inner_metrics(inner_metrics)
        metrics.update(self._metrics(stats, num_kept, target))
        return result, metrics

    def _filter(self, batch: ExperienceBatch, stats: dict[str, float]) -> ExperienceBatch:
        """Rows of the groups the filter keeps; each verdict's reason is counted."""
        rows_of: dict[int, list[int]] = defaultdict(list)
        for row, group_id in enumerate(batch.group_ids.tolist()):
            rows_of[group_id].append(row)
        stats["generated_groups"] += len(rows_of)
        keep = []
        for rows in rows_of.values():
            verdict = self.filter.predicate(batch.select(rows), self.cfg.eps)
            if verdict.reason is not None:
                stats[f"{'kept' if verdict.keep else 'dropped'}_{verdict.reason}"] += 1
            keep += rows if verdict.keep else []
        return batch.select(sorted(keep))

    def _truncate(self, kept: list[ExperienceBatch], target: int, step: int, stats) -> ExperienceBatch:
        """The first `target` whole groups; the rest is carried (keep_surplus) or discarded."""
        batch = concat_batches(kept, self.pad_token_id)
        group_order = list(dict.fromkeys(batch.group_ids.tolist()))  # arrival order, one entry per group
        chosen = set(group_order[:target])
        rows = [i for i, g in enumerate(batch.group_ids.tolist()) if g in chosen]
        rest = [i for i, g in enumerate(batch.group_ids.tolist()) if g not in chosen]
        surplus_groups = len(group_order) - len(chosen)
        if rest and self.cfg.keep_surplus:
            self.surplus = batch.select(rest)
            self.born = {g: self.born.get(g, step) for g in group_order[target:]}
            stats["surplus_carried"] = surplus_groups
        else:
            stats["surplus_discarded"] += surplus_groups
        return batch.select(rows)

    def _take_surplus(self, step: int, stats: dict[str, float]) -> list[ExperienceBatch]:
        """Groups carried from earlier steps that are at most `max_surplus_age` steps old."""
        surplus, self.surplus = self.surplus, None
        if surplus is None:
            self.born = {}
            return []
        young = [i for i, g in enumerate(surplus.group_ids.tolist()) if step - self.born[g] <= self.cfg.max_surplus_age]
        stale = _num_groups([surplus]) - _num_groups([surplus.select(young)])
        if stale:
            stats["surplus_expired"] += stale
            logger.info("[Dynamic Sampling] Step %d: discarded %d carried groups older than %d steps",
                        step, stale, self.cfg.max_surplus_age)
        return [surplus.select(young)] if young else []

    def _bound_reached(self, step: int, num_kept: int, target: int) -> None:
        message = (f"dynamic sampling: {self.max_gen_batches} generation batches gave only {num_kept}/{target} "
                   f"groups with mixed outcomes at step {step}")
        if self.cfg.on_max_gen_batches == "error":
            raise SamplingBoundReached(
                message + "; raise dynamic_sampling.max_gen_batches (0 = unbounded), use easier/harder data, "
                "or set dynamic_sampling.on_max_gen_batches=train_on_kept")
        if num_kept == 0:
            logger.warning("%s: every group was filtered, this step makes no update", message)
        else:
            logger.warning("%s: training on the %d kept groups", message, num_kept)

    def _metrics(self, stats: dict[str, float], num_kept: int, target: int) -> dict[str, float]:
        generated = stats["generated_groups"]
        dropped = sum(stats[name] for name in self.filter.metrics if name.startswith("dropped_"))
        names = ("num_gen_batches", "generated_groups", *self.filter.metrics,
                 "surplus_carried", "surplus_discarded", "surplus_expired")
        metrics = {f"dynamic_sampling/{name}": stats[name] for name in names}
        metrics.update({
            "dynamic_sampling/num_accumulated_prompts": float(num_kept),
            "dynamic_sampling/target_prompt_num": float(target),
            "dynamic_sampling/kept_groups": float(generated - dropped),
            "dynamic_sampling/discarded_groups": float(dropped),
            "dynamic_sampling/filtered_fraction": dropped / generated if generated else math.nan,
        })
        return metrics

    def state_dict(self) -> dict:
        return {**super().state_dict(), "surplus": self.surplus, "born": dict(self.born)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.surplus, self.born = state["surplus"], dict(state["born"])


def _num_groups(batches: list[ExperienceBatch]) -> int:
    return len({g for batch in batches for g in batch.group_ids.tolist()})


def _merge_inner_metrics(per_call: list[dict[str, float]]) -> dict[str, float]:
    """Counts (`num_*` keys) add up over the generation batches; other values are averaged."""
    merged: dict[str, list[float]] = defaultdict(list)
    for metrics in per_call:
        for key, value in metrics.items():
            merged[key].append(value)
    return {key: (sum(v) if key.rsplit("/", 1)[-1].startswith("num_") else sum(v) / len(v)) for key, v in merged.items()}
