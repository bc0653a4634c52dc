"""Calibration is undefined, not perfect, when no answer stated a confidence (MTPO's evaluation counts
a missing confidence as 0, which would score a model that never answered as Brier 0, ECE 0)."""

import math

import pytest
import torch

from aligner_ext.experience.calibration_metrics import calibration_metrics

CALIBRATION = ("mean_confidence", "brier", "ece", "auroc")


def test_no_valid_answer_leaves_calibration_undefined():
    # every answer invalid: no round 2, no confidence (stand-in 0), every answer wrong
    zeros = torch.zeros(4, dtype=torch.float64)
    metrics = calibration_metrics(zeros, zeros, "val/", stated=torch.zeros(4, dtype=torch.bool))
    assert all(math.isnan(metrics[f"val/{name}"]) for name in CALIBRATION)
    assert metrics["val/accuracy"] == 0.0
    # what the stand-in zeros alone would report
    assert calibration_metrics(zeros, zeros, "val/")["val/brier"] == 0.0


def test_valid_answers_without_a_parsed_confidence_leave_calibration_undefined():
    correct = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    metrics = calibration_metrics(torch.zeros(3), correct, "", stated=torch.zeros(3, dtype=torch.bool))
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert all(math.isnan(metrics[name]) for name in CALIBRATION)


def test_one_stated_confidence_keeps_the_missing_ones_at_zero():
    # confidences [0.8, 0 (missing)], outcomes [1, 0]: Brier (0.2^2 + 0) / 2; ECE (0.2 + 0) / 2 (bins 8 and 0)
    metrics = calibration_metrics(torch.tensor([0.8, 0.0], dtype=torch.float64), torch.tensor([1.0, 0.0]), "",
                                  stated=torch.tensor([True, False]))
    assert metrics["brier"] == pytest.approx(0.02) and metrics["ece"] == pytest.approx(0.1)
    assert metrics["mean_confidence"] == pytest.approx(0.4) and metrics["auroc"] == 1.0


def test_stated_must_match_the_answers():
    with pytest.raises(ValueError, match=r"\[N\]"):
        calibration_metrics(torch.zeros(2), torch.zeros(2), "", stated=torch.zeros(3, dtype=torch.bool))
