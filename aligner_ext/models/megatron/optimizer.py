"""Gradient buffers and the optimizer of the Megatron backend: megatron-core's DistributedDataParallel
(gradients accumulate in float32 `main_grad` buffers and are reduced over DP once per update) and
its optimizer (AdamW, optionally the distributed optimizer that shards optimizer state over DP).

Gradient reduction: the losses arrive divided by the *global* counts of the update (all
micro-batches of all DP ranks; losses/base.py), so the DP reduction must be a plain SUM. With
`calculate_per_token_loss` set (model.py) DDP sums instead of averaging, and `finalize_grads`
calls megatron-core's `finalize_model_grads` without a token count so nothing is rescaled; it
still all-reduces what TP/PP sharing requires (per-head q/k norm weights over TP: Qwen3's and
Gemma 3's, by `qk_layernorm`; the tied embedding between the first and last pipeline stage; the
replicated norm weights, post-norms included, under sequence parallelism). OLMo's q/k norms over
the projection are TP-sharded like the heads (model.ProjectionRMSNorm): each rank's gradient is
whole for its slice, so they are in neither all-reduce (`qk_layernorm` off, no sequence-parallel
mark) and the gradient norm counts them on every TP rank (`tensor_model_parallel`).

Clipping: `clipped_step` runs the optimizer's own stages (gradients prepared, global L2 norm over
every TP/PP/DP shard, step) and scales the gradients in between by min(1, max_norm / (norm + 1e-6)),
the same rule as torch's `clip_grad_norm_` in the HF backend; megatron-core's own clipping asserts
CUDA tensor types, so it cannot run on the CPU test path.

Decisions: megatron-core's optimizer skips weight decay on biases and 1-D weights (norms), as
Megatron-LM does; the HF backend decays every parameter (identical when weight_decay = 0, the
default). The learning rate is set per RL step by `set_lr` from the same schedule as the HF backend.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from aligner_ext.models.settings import OptimConfig


def finalize_grads(model_chunks, num_tokens=None, **kwargs) -> None:
    """Reduce gradients over DP (sum) and the TP/PP-shared weights; no token-count rescaling."""
    finalize_model_grads(model_chunks, num_tokens=None)


def wrap_ddp(model: torch.nn.Module, use_distributed_optimizer: bool) -> DistributedDataParallel:
    """`model` in megatron-core's DDP (float32 gradient buffers), wired into the schedules' config."""
    config = model.config
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        module=model,
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_grads
    return ddp


def build_optimizer(ddp: DistributedDataParallel, optim: OptimConfig, use_distributed_optimizer: bool):
    """megatron-core's AdamW over the DDP model's parameters (float32 master weights under bf16)."""
    config = ddp.config
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.beta1,
            adam_beta2=optim.beta2,
            adam_eps=optim.eps,
            clip_grad=0.0,  # clipping is done by `clipped_step`
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [ddp],
    )


def apply_settings(optimizer, optim: OptimConfig) -> None:
    """This run's betas, eps and weight decay over a restored optimizer (a resume may change them; the
    learning rate is set by `set_lr`). Each group keeps its weight-decay multiplier (0 for the
    parameters megatron-core exempts from decay)."""
    for group in optimizer.param_groups:
        group.update(betas=(optim.beta1, optim.beta2), eps=optim.eps,
                     weight_decay=optim.weight_decay * group.get("wd_mult", 1.0))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clipped_step(optimizer, max_norm: float, admit: Callable[[float], bool]) -> float | None:
    """Clip the gradients to a global L2 norm of `max_norm` (0: no clipping) and step, if `admit(norm)`
    allows it (a non-finite norm: `NonFiniteGuard`); return the norm, or None for a skipped step
    (its gradients are zeroed by the next update's `zero_grad_buffer`)."""
    found_inf = optimizer.prepare_grads()  # only a loss-scaled (fp16) optimizer checks; bf16 shows it in the norm
    norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
    if not admit(norm):
        return None
    coefficient = max_norm / (norm + 1e-6)
    if max_norm > 0 and coefficient < 1.0:
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            for param in inner.get_parameters():
                if param.grad is not None:
                    param.grad.mul_(coefficient)
    if not optimizer.step_with_ready_grads():
        raise RuntimeError("the megatron optimizer step did not succeed")
    return norm
