"""A dense reward for the small end-to-end runs, loaded by dotted path `e2e_rewards.digit_fraction`.

A barely trained model almost never answers right, so with the real reward every advantage would be
0 and a resume test would compare two untouched models. The share of digits in a response varies
from sample to sample, so every step updates the weights.
"""

from aligner_ext.rewards.base import RewardResult


def digit_fraction(response, row):
    score = sum(ch.isdigit() for ch in response) / max(1, len(response))
    return RewardResult(score=score, correct=float(score > 0.5))


def always_wrong(response, row):
    """Every sample fails, so every group's outcomes agree."""
    return RewardResult(score=0.0, correct=0.0)


def character_parity(response, row):
    """The parity of the response's character codes: a fair coin per sample, whatever the model writes
    (a random-weight model may write no digit at all), so that dynamic sampling finds mixed groups."""
    score = float(sum(map(ord, response)) % 2)
    return RewardResult(score=score, correct=score)


def always_raises(response, row):
    """A reward function broken for every call: each one falls back to reward.fallback_score."""
    raise RuntimeError("this reward function always fails")


def thirds_agree(response, row):
    """Rows numbered a multiple of 3 score 0 in every sample (a group dynamic sampling drops); the others score
    the sum of the response's character codes mod 97 (samples differ, a group it keeps on `seq_reward`), so
    which groups are dropped follows from the prompt stream alone."""
    if int(row.row_id.rsplit(":", 1)[1]) % 3 == 0:
        return RewardResult(score=0.0, correct=0.0)
    return RewardResult(score=sum(map(ord, response)) % 97 / 97, correct=0.0)
