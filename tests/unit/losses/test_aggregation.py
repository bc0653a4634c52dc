"""Aggregation modes on a 2x3 example worked out by hand."""

import pytest
import torch

from aligner_ext.losses.aggregation import aggregate
from aligner_ext.losses.base import GlobalCounts

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])
FULL = GlobalCounts(tokens=3, sequences=2)  # this 2x3 batch is the whole step


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ],
)
def test_modes_on_the_whole_step(mode, expected):
    assert aggregate(VALUES, MASK, mode, FULL).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 10),
        ("seq-mean-token-mean", 5.5 / 4),
        ("seq-mean-token-sum", 7 / 4),
    ],
)
def test_modes_divide_by_the_global_counts_given(mode, expected):
    # as one micro-batch of a step with 10 tokens in 4 sequences
    assert aggregate(VALUES, MASK, mode, GlobalCounts(tokens=10, sequences=4)).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_masked_out_values_never_leak(mode):
    values = VALUES.clone()
    values[0, 2] = float("nan")
    values[1, 1] = float("inf")
    assert torch.isfinite(aggregate(values, MASK, mode, FULL))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_nothing_masked_in_gives_zero(mode):
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert aggregate(VALUES, empty, mode, GlobalCounts(tokens=0, sequences=0)).item() == 0.0


def test_unknown_mode_lists_known_ones():
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        aggregate(VALUES, MASK, "sum", FULL)


def test_mask_must_be_bool_and_shapes_agree():
    with pytest.raises(ValueError, match="bool"):
        aggregate(VALUES, MASK.float(), "token-mean", FULL)
    with pytest.raises(ValueError, match="shape"):
        aggregate(VALUES, MASK[:, :2], "token-mean", FULL)
