"""Calibration of stated confidences c_i in [0, 1] against correctness y_i in {0, 1}, over N answers.

    Brier  = mean_i (c_i - y_i)^2
    ECE    = sum_b (n_b / N) |mean_{i in b} c_i - mean_{i in b} y_i|      B equal-width bins on [0, 1]
    AUROC  = P(c_pos > c_neg) + P(c_pos = c_neg) / 2                     pos: y = 1, neg: y = 0

These are RLCR's evaluation metrics (Damani et al. 2025; `eval/eval_utils.py` there), computed here
in float64 on tensors.

Decisions (tests/unit/experience/test_mtpo_calibration_metrics.py pins them):
- Bin b holds b/B <= c < (b+1)/B, computed as floor(c * B + 1e-6) in float64; c = 1 goes to the
  last bin. The tolerance puts a confidence stored in float32 on its decimal edge (0.9 is stored as
  0.89999998) in the bin it was written for. RLCR digitizes against `linspace(0, 1, 11)`, whose
  edge 0.30000000000000004 puts c = 0.3 in the bin of 0.2; here one-decimal confidences each get
  their own bin.
- AUROC is the Mann-Whitney statistic with ties counted one half, which equals the area under the
  trapezoidal ROC curve (scikit-learn's `roc_auc_score`). It is NaN when all answers are right or
  all wrong (the ROC curve is undefined); Brier and ECE are NaN for N = 0.
- An answer without a stated confidence (no valid answer, so no round 2, or no parseable
  `<confidence>`) counts with confidence 0, as in RLCR's evaluation, so long as some answer stated
  one. When none did (`stated` all false), mean confidence, Brier, ECE and AUROC are NaN, undefined:
  the zeros standing in for the missing confidences would score a model that never stated one, and
  never answered right, as perfectly calibrated (Brier 0, ECE 0).
"""

from __future__ import annotations

import math

import torch

NUM_BINS = 10  # equal-width bins of the ECE
EDGE_TOLERANCE = 1e-6  # a confidence this close below a bin edge counts as on it (float32 storage)


def _check(confidence: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if confidence.dim() != 1 or confidence.shape != correct.shape:
        raise ValueError(f"confidence {tuple(confidence.shape)} and correct {tuple(correct.shape)} must both be [N]")
    c, y = confidence.to(torch.float64), correct.to(torch.float64)
    if ((c < 0) | (c > 1) | c.isnan()).any():
        raise ValueError("confidences must lie in [0, 1]")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("correctness must be 0 or 1")
    return c, y


def brier_score(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """mean (c - y)^2 over [N] confidences and [N] 0/1 outcomes; NaN for N = 0."""
    c, y = _check(confidence, correct)
    return float((c - y).square().mean()) if len(c) else math.nan


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """sum_b (n_b / N) |mean c_b - mean y_b| over `num_bins` equal-width bins; NaN for N = 0."""
    c, y = _check(confidence, correct)
    if not len(c):
        return math.nan
    bins = (c * num_bins + EDGE_TOLERANCE).floor().long().clamp(max=num_bins - 1)
    gap = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, c - y)
    return float(gap.abs().sum() / len(c))  # |sum_b (c - y)| / N = (n_b / N) |mean c_b - mean y_b|


def auroc(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """P(c of a right answer > c of a wrong one), ties one half; NaN without both kinds of answers."""
    c, y = _check(confidence, correct)
    positives, negatives = c[y == 1], c[y == 0]
    if not len(positives) or not len(negatives):
        return math.nan
    # rank-sum form: average 1-based ranks of the confidences, tied values sharing their mean rank
    _, inverse, counts = torch.unique(c, return_inverse=True, return_counts=True)
    mean_rank = (counts.cumsum(0) - (counts - 1) / 2).to(torch.float64)
    pos, neg = len(positives), len(negatives)
    return float((mean_rank[inverse][y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def calibration_metrics(confidence: torch.Tensor, correct: torch.Tensor, prefix: str,
                        stated: torch.Tensor | None = None) -> dict[str, float]:
    """{prefix}accuracy, mean_confidence, brier, ece, auroc of [N] confidences and 0/1 outcomes.

    `stated` ([N] bools, default all true): whether answer i stated its confidence; with none stated,
    every metric but accuracy is NaN (the module docstring says why)."""
    c, y = _check(confidence, correct)
    accuracy = float(y.mean()) if len(y) else math.nan
    if stated is not None:
        if stated.shape != c.shape:
            raise ValueError(f"stated {tuple(stated.shape)} and confidence {tuple(c.shape)} must both be [N]")
        if not stated.any():
            c, y = c[:0], y[:0]  # nothing to calibrate: the N = 0 case
    return {
        f"{prefix}accuracy": accuracy,
        f"{prefix}mean_confidence": float(c.mean()) if len(c) else math.nan,
        f"{prefix}brier": brier_score(c, y),
        f"{prefix}ece": expected_calibration_error(c, y),
        f"{prefix}auroc": auroc(c, y),
    }
