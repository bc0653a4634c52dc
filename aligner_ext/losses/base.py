"""Loss interface: a loss turns one micro-batch's log-probs into a scalar whose sum over
micro-batches equals the full-batch loss.

For that, every loss divides by *global* counts of the optimizer step (all micro-batches, and later
all data-parallel ranks) passed in as `GlobalCounts`, never by counts of the micro-batch it sees.
Metrics follow the same rule: each value a loss returns is already divided by the global count, so
the caller sums metrics over micro-batches.

The caller's contract, for one optimizer step over `step_batch` split into micro-batches:

    counts = loss.global_counts(step_batch)          # once, over the whole step
    for micro in micro_batches:
        value, metrics = loss(policy_logprobs(micro), micro, counts)
        value.backward()                             # gradients add up to the full-batch gradient
        sum metrics key by key

Each loss declares the batch fields it reads in `reads`; `check_batch` turns a missing one into an
error that names it, before any arithmetic.
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
    """A loss on one micro-batch, normalised by the step's global counts.

    Subclasses set `reads` (the ExperienceBatch fields they need besides the log-probs; an instance
    may extend it from its config) and implement `__call__`. Wrappers that change what counts (e.g.
    per-segment masks) override `global_counts`.
    """

    reads: tuple[str, ...] = ("response_mask",)

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
        """Counts over `batch`, which must be the whole optimizer step (not one micro-batch)."""
        mask = batch.response_mask
        return GlobalCounts(tokens=int(mask.sum()), sequences=int(mask.any(dim=1).sum()))

    def check_batch(self, logprobs: torch.Tensor, batch: ExperienceBatch) -> None:
        """Raise if a field in `reads` is unset or the log-probs do not match the response shape."""
        missing = [name for name in self.reads if getattr(batch, name) is None]
        if missing:
            raise ValueError(f"{type(self).__name__} reads batch field(s) {missing}, which are not set")
        expected = tuple(batch.response_mask.shape)
        if tuple(logprobs.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}: logprobs have shape {tuple(logprobs.shape)}, "
                f"expected the response shape {expected}"
            )
