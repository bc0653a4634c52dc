"""Per-step metrics computed from the experience batch (rewards, lengths, advantages, and the gap
between the engine's sampling log-probs and the trainer's)."""

from __future__ import annotations

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.groups import groups_all_agree

ZERO_STD_EPS = 1e-6  # reward std at or below this counts as "all samples agree"


def batch_metrics(batch: ExperienceBatch) -> dict[str, float]:
    """Reward, accuracy, lengths, zero-std groups, advantage range, entropy, finish reasons."""
    lengths = batch.response_lengths.float()
    valid, sampled = batch.response_valid, batch.sampled
    agree = groups_all_agree(batch.rewards, batch.group_ids, ZERO_STD_EPS)
    advantages = batch.advantages[batch.response_mask] if batch.advantages is not None else torch.zeros(1)
    finish = [sample.finish_reason for sample in batch.samples]
    metrics = {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std(unbiased=False)),
        "reward/accuracy": float(batch.correct.nanmean()),
        "reward/zero_std_group_fraction": float(sum(agree.values()) / max(1, len(agree))),
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
