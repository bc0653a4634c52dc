"""Per-step metrics computed from the experience batch (rewards, lengths, advantages, the gap
between the engine's sampling log-probs and the trainer's, and how stale the sampled tokens are)."""

from __future__ import annotations

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.groups import groups_all_agree

ZERO_STD_EPS = 1e-6  # reward std at or below this counts as "all samples agree"


def batch_metrics(batch: ExperienceBatch) -> dict[str, float]:
    """Reward, accuracy, prompt and response lengths, zero-std groups, advantage range, entropy, finish reasons."""
    lengths = batch.response_lengths.float()
    prompt_lengths = batch.prompt_mask.sum(dim=1).float()
    valid, sampled = batch.response_valid, batch.sampled
    agree = groups_all_agree(batch.rewards, batch.group_ids, ZERO_STD_EPS)
    advantages = batch.advantages[batch.response_mask] if batch.advantages is not None else torch.zeros(1)
    finish = [sample.finish_reason for sample in batch.samples]
    metrics = {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std(unbiased=False)),
        "reward/accuracy": float(batch.correct.nanmean()),
        "reward/zero_std_group_fraction": float(sum(agree.values()) / max(1, len(agree))),
        "prompt/length_mean": float(prompt_lengths.mean()),
        "prompt/length_max": float(prompt_lengths.max()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/num_tokens": float(valid.sum()),
        "response/clipped_fraction": finish.count("length") / len(finish),
        "response/stop_fraction": finish.count("stop") / len(finish),
        "advantage/min": float(advantages.min()) if advantages.numel() else 0.0,
        "advantage/max": float(advantages.max()) if advantages.numel() else 0.0,
        "actor/entropy": float((batch.entropy * sampled).sum() / sampled.sum().clamp(min=1)),
        "batch/num_samples": float(len(batch)),
        "batch/num_groups": float(len(agree)),
    }
    metrics.update(logprob_mismatch(batch))
    metrics.update(staleness_metrics(batch))
    return metrics


def logprob_mismatch(batch: ExperienceBatch) -> dict[str, float]:
    """|engine log-prob - trainer log-prob| over the sampled tokens, mean and max (when the engine
    returned its log-probs, `rollout.return_logprobs`). The two differ by the engine's and the
    trainer's numerics, by top-p / top-k (the engine reports the filtered distribution), and under
    the graded system prompt by design (the engine saw another prompt)."""
    if batch.generation_logprobs is None or batch.old_logprobs is None:
        return {}
    gap = (batch.generation_logprobs - batch.old_logprobs).abs()[batch.sampled]
    if not gap.numel():
        return {}
    return {"rollout/logprob_diff_mean": float(gap.mean()), "rollout/logprob_diff_max": float(gap.max())}


def staleness_metrics(batch: ExperienceBatch) -> dict[str, float]:
    """Over the sampled tokens: `staleness/mean` and `_max` (versions behind the proximal policy,
    docs/async.md), the share of tokens at each lag d (`staleness/share_lag_d`, a histogram over the
    lags present) and the engine/trainer log-prob gap at each lag (`rollout/logprob_diff_mean_lag_d`):
    the gap of lag 0 is the engines' numerics alone, a later lag's adds the updates in between."""
    if batch.staleness is None:
        return {}
    lags = batch.staleness[batch.sampled]
    if not lags.numel():
        return {}
    metrics = {"staleness/mean": float(lags.double().mean()), "staleness/max": float(lags.max())}
    gap = None
    if batch.generation_logprobs is not None and batch.old_logprobs is not None:
        gap = (batch.generation_logprobs - batch.old_logprobs).abs()[batch.sampled]
    for lag in lags.unique().tolist():
        at_lag = lags == lag
        metrics[f"staleness/share_lag_{lag}"] = float(at_lag.double().mean())
        if gap is not None:
            metrics[f"rollout/logprob_diff_mean_lag_{lag}"] = float(gap[at_lag].mean())
    return metrics
