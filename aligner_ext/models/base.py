"""The policy-backend interface: log-probs of response tokens, and a training step on a loss.

A backend owns the model, its optimizer and LR schedule. The loop only calls the methods below, so
the HF backend and the Megatron-core backend are interchangeable.
"""

from __future__ import annotations

import abc
import logging
import math
from pathlib import Path
from typing import Protocol

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.errors import UserError
from aligner_ext.losses.base import Loss
from aligner_ext.registry import Registry

POLICIES = Registry("policy backend")
logger = logging.getLogger(__name__)


class NonFiniteUpdates(UserError, RuntimeError):
    """Too many optimizer updates in a row had a non-finite loss or gradient norm."""


class DivergedRun(UserError, RuntimeError):
    """An optimizer update moved the weights by more than policy.optim.max_update_ratio of their norm."""


def weights_norm(params) -> float:
    """The global L2 norm of `params` (inf once a value's square overflows: an exploded model)."""
    norms = [torch.linalg.vector_norm(param.detach(), dtype=torch.promote_types(param.dtype, torch.float32))
             for param in params]  # bfloat16 weights: summed in float32, not rounded to 3 digits
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


class NonFiniteGuard:
    """Decides whether an optimizer update may be applied: not when its loss or gradient norm is
    NaN or infinite (applying it would poison the weights and every checkpoint after them). Skipped
    updates are counted and logged; `limit` of them in a row stop the run, before a checkpoint of
    the diverged state could be written. Its counts travel in the policy's checkpoint state.

    Finite but broken weights (lr=1e30) pass that test, so `diverged` also judges an applied update
    by how far it moved the weights: |norm after - norm before| / norm before above
    `max_update_ratio` counts as a diverged update, which the loop answers by stopping without a
    checkpoint (trainer/loop.py). The change of norm bounds the update's own norm from below and
    needs no copy of the weights."""

    def __init__(self, limit: int, max_update_ratio: float = 0.0):
        if limit < 1:
            raise ValueError(f"policy.optim.max_nonfinite_in_a_row must be >= 1, got {limit}")
        self.limit = limit
        self.max_update_ratio = max_update_ratio
        self.in_a_row = 0
        self.skipped = 0  # over the run

    def diverged(self, norm_before: float, norm_after: float) -> tuple[float, bool]:
        """(the update's ratio, whether it exceeds max_update_ratio; 0 turns the check off)."""
        change = abs(norm_after - norm_before)
        ratio = change / norm_before if norm_before > 0 and math.isfinite(change) else math.inf
        if self.max_update_ratio and ratio > self.max_update_ratio:
            logger.error("an optimizer update changed the weights' norm from %.4g to %.4g (ratio %.3g > "
                         "policy.optim.max_update_ratio=%g)", norm_before, norm_after, ratio, self.max_update_ratio)
            return ratio, True
        return ratio, False

    def admit(self, grad_norm: float, loss: float = 0.0) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        logger.warning("skipped an optimizer update: loss %s, gradient norm %s (%d in a row, %d in the run)",
                       loss, grad_norm, self.in_a_row, self.skipped)
        if self.in_a_row >= self.limit:
            raise NonFiniteUpdates(
                f"{self.in_a_row} optimizer updates in a row had a non-finite loss or gradient norm (last: loss "
                f"{loss}, gradient norm {grad_norm}); stopping. The weights hold the last finite update and no "
                "checkpoint of a diverged state was written. Lower policy.optim.lr, check the rewards and the "
                "data, or raise policy.optim.max_nonfinite_in_a_row to skip more")
        return False

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = state["in_a_row"], state["skipped"]


def record_applied(guard: NonFiniteGuard, update: dict[str, float], grad_norm: float, norms: tuple[float, float],
                   totals: dict[str, float], grad_norms: list[float], ratios: list[float]) -> bool:
    """Add an applied update to a train call's tallies (its loss terms, gradient norm and update
    ratio); True when the guard judges it diverged: no further update on those weights, the loop
    stops the run. Both backends' train loops call it."""
    grad_norms.append(grad_norm)
    ratio, broken = guard.diverged(*norms)
    ratios.append(ratio)
    for key, value in update.items():
        totals[key] += value
    return broken


def update_metrics(totals: dict[str, float], grad_norms: list[float], skipped: int,
                   update_ratios: list[float] | None = None, diverged: int = 0) -> dict[str, float]:
    """A step's training metrics: the losses' terms averaged over the applied updates, the gradient
    norms (NaN when every update was skipped), the counts, and, where the backend measures them, the
    largest update ratio (NonFiniteGuard.diverged) and the diverged updates the loop stops on."""
    applied = len(grad_norms)
    metrics = {key: value / applied for key, value in totals.items()} if applied else {}
    metrics["actor/grad_norm"] = sum(grad_norms) / applied if applied else float("nan")
    metrics["actor/grad_norm_max"] = max(grad_norms) if applied else float("nan")
    metrics["actor/num_updates"] = float(applied)
    metrics["actor/skipped_updates"] = float(skipped)
    if update_ratios is not None:
        metrics["actor/update_ratio_max"] = max(update_ratios) if update_ratios else float("nan")
        metrics["actor/diverged_updates"] = float(diverged)
    return metrics


class Reference(Protocol):
    """The KL penalty's reference, the starting policy: a frozen copy, or with LoRA the policy's own model
    with its adapters switched off (docs/lora.md)."""

    def logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        """Log-probs [B, R] of the response tokens, float32 on the CPU, zero past each response."""


class ShardedWrite(Protocol):
    """A policy's background write of its sharded state (`Policy.save_sharded(directory, background=True)`)."""

    def finished(self, wait: bool) -> bool:
        """Whether every process has written its part, completing the write if so (collective); `wait`:
        until they have. Raises the write's failure."""


class Policy(abc.ABC):
    """A trainable policy."""

    model: torch.nn.Module | None  # the HF module checkpoints save; None where they hold no HF weights (no HF copy kept, or the Megatron backend's LoRA adapters)
    device: torch.device  # where it trains
    restores_own_weights: bool = False  # `load_sharded` restores the weights: a resume skips the checkpoint's model.safetensors
    version: int = 0  # optimizer updates applied so far (the policy version, saved in checkpoints): `train` adds its applied updates when it returns, so during a step it is the version of the proximal policy, the weights before the step's update
    reads_routing: bool = False  # its forwards read the experts the engine's routers chose (a mixture of experts on either backend, models/moe.py, models/megatron/moe.py): the experience makers ask the engine for them
    def fills_old_logprobs(self, batch_size: int) -> bool:
        """Whether `train` would fill a batch of this size that has no old log-probs from its own
        forward (the on-policy shortcut, trainer/loop.py): the loss then sees old = current, detached."""
        return False

    @abc.abstractmethod
    def logprobs(self, batch: ExperienceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad (log-probs [B, R], entropy [B, R]) of the response tokens, float32, on the CPU."""

    @abc.abstractmethod
    def train(self, batch: ExperienceBatch, loss: Loss, temperature: float) -> dict[str, float]:
        """Run `num_iterations` passes of optimizer updates on the batch; return summed metrics."""

    @abc.abstractmethod
    def state_dict(self, optimizer: bool = True) -> dict:
        """Training state that is the same on every process (optimizer, LR schedule); the trainer saves
        rank 0's. The weights are saved from `model`; state split over processes by `save_sharded`.
        `optimizer=False`: without the optimizer's moments and master weights (a weights-only
        checkpoint, `trainer.save_optimizer=false`), which `load_state_dict` then leaves fresh."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def frozen_reference(self) -> Reference:
        """The KL reference, built from the weights the policy starts from (call before any training)."""

    def generation_model(self, engine_name: str) -> torch.nn.Module:
        """What the generation engine `engine_name` runs, handed to it again after each update
        (`engine.update_weights`). Default: `model`."""
        return self.model

    def sync_weights(self) -> None:
        """Bring `model` (what the generation engine samples and checkpoints save) up to date after
        `train`; the loop calls it in its weight-sync stage. Default: nothing (the backend trains
        `model` itself)."""

    def save_sharded(self, directory: Path, background: bool = False, optimizer: bool = True) -> ShardedWrite | None:
        """Write the state that differs between processes (a sharded model and optimizer) under the
        checkpoint `directory`, in a subdirectory of the backend's own. Called on every process,
        collectively, while the checkpoint is written. `background`: may return once the state is
        copied, the write going on (a `ShardedWrite`, which the checkpointer finishes); None when it is
        written. `optimizer=False`: the weights alone. Default: nothing (`state_dict` holds it all)."""
        return None

    def load_sharded(self, directory: Path, optimizer: bool = True) -> None:
        """Restore what `save_sharded` wrote under the checkpoint `directory` (every process, before
        `load_state_dict`); `optimizer=False`: a weights-only checkpoint, the optimizer left fresh.
        Default: nothing."""

    @abc.abstractmethod
    def save_pretrained(self, directory: str) -> None:
        """Write the weights as an HF checkpoint directory (safetensors)."""

    @abc.abstractmethod
    def checkpoint_bytes(self, optimizer: bool = True) -> int:
        """Estimated bytes of the weights and optimizer state one checkpoint holds (`optimizer=False`:
        the weights alone), every process's together (trainer/disk_space.py checks they fit before
        step 1). Collective for a sharded policy."""

    @abc.abstractmethod
    def export_bytes(self) -> int:
        """Estimated bytes of the weights `save_pretrained` writes."""
