"""The policy-backend interface: log-probs of response tokens, and a training step on a loss.

A backend owns the model, its optimizer and LR schedule. The loop only calls the methods below, so
the HF backend and the Megatron-core backend are interchangeable.
"""

from __future__ import annotations

import abc
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.errors import UserError
from aligner_ext.losses.base import Loss
from aligner_ext.registry import Registry
from aligner_ext.rules import choice, number, plugin

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


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (one schedule step per RL step)."""

    lr: float = number(1e-6, ge=0)  # peak learning rate (typical for billion-parameter policies; conf/demo.yaml sets the tiny model's)
    weight_decay: float = number(0.0, ge=0)  # AdamW decoupled weight decay
    beta1: float = number(0.9, ge=0, lt=1)  # AdamW first-moment decay
    beta2: float = number(0.999, ge=0, lt=1)  # AdamW second-moment decay
    eps: float = number(1e-8, gt=0)  # AdamW denominator epsilon
    grad_clip: float = number(1.0, ge=0)  # max global gradient L2 norm; 0 disables clipping
    schedule: str = choice("constant", "constant", "linear", "cosine")  # constant | linear | cosine (decay to min_lr_ratio * lr after warm-up)
    warmup_steps: int = number(0, ge=0)  # RL steps of linear warm-up from 0 to lr
    min_lr_ratio: float = number(0.0, ge=0, le=1)  # final lr / peak lr for linear and cosine decay
    max_nonfinite_in_a_row: int = number(3, ge=1)  # an update with a non-finite loss or gradient norm is skipped (and counted); this many in a row stop the run
    max_update_ratio: float = number(0.1, ge=0)  # an update changing the weights' L2 norm by more than this fraction of it diverged: the run stops (exit 2) without saving it (0 disables)


@dataclass
class PolicyConfig:
    """Which backend trains the policy, and how a batch is split for it."""

    backend: str = plugin("hf", "aligner_ext.models.base:POLICIES")  # registered policy backend
    dtype: str = choice("auto", "auto", "float32", "bfloat16", "float64")  # auto (bfloat16 on a GPU that supports it, else float32) | float32 | bfloat16 | float64
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    micro_batch_size: int = number(64, ge=1)  # sequences per forward/backward (memory knob; does not change the gradient)
    mini_batch_size: int = number(0, ge=0)  # sequences per optimizer update; 0 = the whole step batch (one update)
    num_iterations: int = number(1, ge=1)  # passes over each step batch against the stored old log-probs
    old_logprob_pass: str = choice("auto", "auto", "always")  # auto: skipped when the step is one on-policy update (the training forward's detached log-probs are the old ones) | always
    logprob_chunk_size: int = number(4096, ge=1)  # response tokens per chunk of the fused log-prob head (bounds its [tokens, vocab] logits)
    kernels: str = choice("auto", "auto", "none", "liger")  # training kernels: liger (HF backend: Liger-Kernel's Triton RMSNorm, SwiGLU, RoPE, models/kernels.py; megatron backend: Liger's RMSNorm and megatron-core's fused SwiGLU / GeGLU, models/megatron/model.py, less memory; CUDA; extra liger) | none (the plain modules) | auto (liger where it runs: a CUDA device and the package; measured faster on both backends)
    tensor_model_parallel_size: int = number(1, ge=1)  # megatron backend: GPUs each layer is split across (TP)
    pipeline_model_parallel_size: int = number(1, ge=1)  # megatron backend: pipeline stages the layers are split into (PP)
    sequence_parallel: bool = False  # megatron backend: shard norm/dropout activations over TP ranks (TP > 1)
    use_distributed_optimizer: bool = False  # megatron backend: shard optimizer state over data-parallel ranks
    micro_batch_tokens: int = number(0, ge=0)  # pack whole sequences end to end into micro-batches of at most this many tokens (both backends; no compute on pads; a longer sequence goes alone); 0 = micro_batch_size rows per micro-batch, padded
    recompute_activations: bool = False  # megatron backend: keep only each layer's input and recompute the layer in the backward (less memory, ~1/3 more compute)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"policy.device={self.device!r}: must be auto, cpu, cuda or cuda:N")


class Reference(Protocol):
    """The KL penalty's reference: a frozen copy of the starting policy."""

    def logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        """Log-probs [B, R] of the response tokens, float32 on the CPU, zero past each response."""


class Policy(abc.ABC):
    """A trainable policy."""

    model: torch.nn.Module | None  # the HF module checkpoints save; None for a backend that keeps no HF copy
    device: torch.device  # where it trains
    restores_own_weights: bool = False  # `load_sharded` restores the weights: a resume skips the checkpoint's model.safetensors
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
    def state_dict(self) -> dict:
        """Training state that is the same on every process (optimizer, LR schedule); the trainer saves
        rank 0's. The weights are saved from `model`; state split over processes by `save_sharded`."""

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

    def save_sharded(self, directory: Path) -> None:
        """Write the state that differs between processes (a sharded model and optimizer) under the
        checkpoint `directory`, in a subdirectory of the backend's own. Called on every process,
        collectively, while the checkpoint is written. Default: nothing (`state_dict` holds it all)."""

    def load_sharded(self, directory: Path) -> None:
        """Restore what `save_sharded` wrote under the checkpoint `directory` (every process, before
        `load_state_dict`). Default: nothing."""

    @abc.abstractmethod
    def save_pretrained(self, directory: str) -> None:
        """Write the weights as an HF checkpoint directory (safetensors)."""
