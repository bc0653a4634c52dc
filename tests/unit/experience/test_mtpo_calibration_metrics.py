"""Brier score, ECE (10 equal-width bins) and AUROC against values worked out by hand."""

import math

import pytest
import torch

from aligner_ext.experience.calibration_metrics import (
    auroc, brier_score, calibration_metrics, expected_calibration_error,
)

C = torch.tensor([0.9, 0.8, 0.8, 0.3, 0.1], dtype=torch.float64)
Y = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)


def test_brier_by_hand():
    # (0.1^2 + 0.2^2 + 0.8^2 + 0.3^2 + 0.9^2) / 5 = (0.01 + 0.04 + 0.64 + 0.09 + 0.81) / 5
    assert brier_score(C, Y) == pytest.approx(1.59 / 5)


def test_ece_by_hand():
    # bins: 0.9 -> 9 (gap -0.1); 0.8, 0.8 -> 8 (mean c 0.8, mean y 0.5: gap 0.3, n 2); 0.3 -> 3 (0.3); 0.1 -> 1 (-0.9)
    # ECE = 1/5 * 0.1 + 2/5 * 0.3 + 1/5 * 0.3 + 1/5 * 0.9 = (0.1 + 0.6 + 0.3 + 0.9) / 5
    assert expected_calibration_error(C, Y) == pytest.approx(1.9 / 5)


def test_ece_pools_a_bin_before_taking_the_gap():
    # 0.62 and 0.68 share bin 6: mean c 0.65, mean y 0.5 -> 0.15 (not (0.38 + 0.68) / 2 = 0.53 per sample)
    c = torch.tensor([0.62, 0.68], dtype=torch.float64)
    assert expected_calibration_error(c, torch.tensor([1.0, 0.0])) == pytest.approx(0.15)


def test_ece_bin_edges_and_float32_storage():
    # 0.2 and 0.3 each get their own bin (RLCR's linspace edges would pool them); 1.0 is in the last bin
    c = torch.tensor([0.2, 0.3, 1.0], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 1.0])
    assert expected_calibration_error(c, y) == pytest.approx((0.8 + 0.3 + 0.0) / 3)
    # stored in float32, 0.9 is 0.89999998: still bin 9, not pooled with 0.8 (pooled: |1.7 - 1| / 3)
    c32 = torch.tensor([0.9, 0.8, 0.8], dtype=torch.float32)
    y32 = torch.tensor([0.0, 1.0, 0.0])
    assert expected_calibration_error(c32, y32) == pytest.approx((0.9 + 0.6) / 3, abs=1e-6)


def test_auroc_by_hand_with_ties():
    # positives 0.9, 0.8, 0.1; negatives 0.8, 0.3. Pairs (pos, neg):
    # (0.9,0.8) 1, (0.9,0.3) 1, (0.8,0.8) tie 1/2, (0.8,0.3) 1, (0.1,0.8) 0, (0.1,0.3) 0 -> 3.5 / 6
    assert auroc(C, Y) == pytest.approx(3.5 / 6)


def test_auroc_extremes_and_undefined():
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert auroc(torch.tensor([0.9, 0.1, 0.8, 0.2]), y) == 1.0
    assert auroc(torch.tensor([0.1, 0.9, 0.2, 0.8]), y) == 0.0
    assert auroc(torch.full((4,), 0.7), y) == 0.5  # a constant confidence ranks nothing
    assert math.isnan(auroc(torch.tensor([0.3, 0.9]), torch.tensor([1.0, 1.0])))


def test_calibration_metrics_bundle_and_bad_input():
    metrics = calibration_metrics(C, Y, "val/")
    assert metrics["val/accuracy"] == pytest.approx(0.6)
    assert metrics["val/mean_confidence"] == pytest.approx(2.9 / 5)
    assert metrics["val/brier"] == pytest.approx(1.59 / 5) and metrics["val/auroc"] == pytest.approx(3.5 / 6)
    empty = calibration_metrics(torch.zeros(0), torch.zeros(0), "")
    assert all(math.isnan(v) for v in empty.values())
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        brier_score(torch.tensor([1.2]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="0 or 1"):
        brier_score(torch.tensor([0.2]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        auroc(torch.tensor([0.2, 0.3]), torch.tensor([1.0]))
