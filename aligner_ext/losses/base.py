"""Loss interface: a loss turns one micro-batch's log-probs into a scalar whose sum over
micro-batches equals the full-batch loss.

For that, every loss divides by *global* counts of the optimizer step (all micro-batches, and later
all data-parallel ranks) passed in as `GlobalCounts`, never by counts of the micro-batch it sees.
Metrics follow the same rule: each value a loss returns is already divided by the global count, so
the caller sums metrics over micro-batches.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.registry import Registry

LOSSES = Registry("loss")


@dataclass(frozen=True)
class GlobalCounts:
    """Normalisers of one optimizer step, counted over every micro-batch (and rank)."""

    tokens: int  # response tokens with response_mask True
    sequences: int  # sequences with at least one masked-in token


class Loss(abc.ABC):
    """A loss on one micro-batch, normalised by the step's global counts."""

    @abc.abstractmethod
    def __call__(
        self,
        logprobs: torch.Tensor,  # [b, R] current policy log-probs of the response tokens (with grad)
        batch: ExperienceBatch,  # the micro-batch (advantages, old/ref log-probs, masks)
        counts: GlobalCounts,
        entropy: torch.Tensor | None = None,  # [b, R] token entropy, for metrics only
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (loss, metrics); both sum to full-batch values over the micro-batches."""

    def global_counts(self, batch: ExperienceBatch) -> GlobalCounts:
        mask = batch.response_mask
        return GlobalCounts(tokens=int(mask.sum()), sequences=int(mask.any(dim=1).sum()))
