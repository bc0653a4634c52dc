"""The policy-backend interface: log-probs of response tokens, and a training step on a loss.

A backend owns the model, its optimizer and LR schedule. The loop only calls the methods below, so
the HF backend and the Megatron-core backend are interchangeable.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.losses.base import Loss
from aligner_ext.registry import Registry

POLICIES = Registry("policy backend")


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (one schedule step per RL step)."""

    lr: float = 1e-6  # peak learning rate (typical for billion-parameter policies; conf/demo.yaml sets the tiny model's)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global gradient L2 norm; 0 disables clipping
    schedule: str = "constant"  # constant | linear | cosine (decay to min_lr_ratio * lr after warm-up)
    warmup_steps: int = 0  # RL steps of linear warm-up from 0 to lr
    min_lr_ratio: float = 0.0  # final lr / peak lr for linear and cosine decay


@dataclass
class PolicyConfig:
    """Which backend trains the policy, and how a batch is split for it."""

    backend: str = "hf"  # registered policy backend
    dtype: str = "auto"  # auto (bfloat16 on a GPU that supports it, else float32) | float32 | bfloat16 | float64
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    micro_batch_size: int = 64  # sequences per forward/backward (memory knob; does not change the gradient)
    mini_batch_size: int = 0  # sequences per optimizer update; 0 = the whole step batch (one update)
    num_iterations: int = 1  # passes over each step batch against the stored old log-probs
    logprob_chunk_size: int = 128  # sequence positions per log-softmax chunk (bounds [b, T, V] memory)
    tensor_model_parallel_size: int = 1  # megatron backend: GPUs each layer is split across (TP)
    pipeline_model_parallel_size: int = 1  # megatron backend: pipeline stages the layers are split into (PP)
    sequence_parallel: bool = False  # megatron backend: shard norm/dropout activations over TP ranks (TP > 1)
    use_distributed_optimizer: bool = False  # megatron backend: shard optimizer state over data-parallel ranks
    optim: OptimConfig = field(default_factory=OptimConfig)


class Policy(abc.ABC):
    """A trainable policy."""

    model: torch.nn.Module

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
