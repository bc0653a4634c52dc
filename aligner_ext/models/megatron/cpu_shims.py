"""Patches that let megatron-core 0.19 run on CPU under the gloo backend (tests and CI only).

megatron-core is written for CUDA. A GPTModel with the local layer spec (no Transformer Engine, no
Apex) runs forward and backward on CPU after three changes (applied only when CUDA is absent):

1. `torch.cuda.current_device()` returns "cpu": layers, the TP communication buffers and the rotary
   embedding allocate on `torch.cuda.current_device()`; a device string works everywhere it is used.
2. The CUDA RNG tracker is the null-fork tracker megatron-core ships for inference
   (`initialize_rng_tracker(inference_rng_tracker=True)`): `fork()` would read CUDA generator
   states. Nothing in our models draws random numbers inside `fork()` (dropout is 0, weights come
   from the HF checkpoint), so the null context changes no value.
3. The attention mask: megatron-core's own `DotProductAttention` needs an explicit causal mask on
   CPU. Our layer spec uses `model.SDPAttention`, which is causal by construction and takes no
   mask, so this shim is built into the model rather than patched here.

The pipeline schedules and the optimizer need two more:

4. `torch.cuda.synchronize()` is a no-op (the p2p code synchronises the GPU after sends; there is
   nothing to wait for on the CPU).
5. Four megatron-core modules create small tensors with a hard-coded `device="cuda"` (the
   schedules' token counter; the optimizer's loss-scale and found-inf flags; the gradient-norm
   buffers of `clip_grads` and of the torch fallback of the L2 norm in `megatron.core.utils`).
   Each of those modules sees a `torch` whose tensor factories map `device="cuda"` to the CPU; no
   other module is affected.

Not covered: megatron-core's distributed optimizer and its bf16 mixed-precision optimizer check
`param.type()` against CUDA tensor type names, so `use_distributed_optimizer` and bf16 training run
on GPUs only (refused on the CPU in one line, `policy.cpu_refusal`); the CPU tests train in float32.

Activation recomputation (`policy.recompute_activations`) one more:
7. megatron-core's checkpoint function saves and restores the CUDA generator state around the
   recomputed layers: on the CPU both are no-ops (nothing is drawn there, see 2).

And tied embeddings with PP > 1 one more:

8. `Tensor.cuda()` returns the tensor itself: GPTModel moves the last stage's copy of the embedding
   to the GPU before all-reducing it with the first stage's. (On a CPU-only torch build `.cuda()`
   can only fail, so no working code path changes.)

And megatron-core 0.19's gradient reduction one more:

9. `torch.cuda.current_stream()` is torch's CPU stream (`torch.cpu.current_stream`): before reducing a
   bucket of gradients, the data-parallel wrapper makes the current stream wait on events that CUDA
   graph replays left on the parameters; none exist on the CPU, and the CPU stream's `wait_event` is a no-op.

Decision: patch process-wide (megatron-core calls `torch.cuda.current_device` from many modules);
`apply_cpu_shims` refuses to run when CUDA is available, so a GPU run can never be patched.
"""

from __future__ import annotations

import torch

_applied = False


def _cpu_device() -> str:
    return "cpu"


def _no_sync() -> None:
    return None


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _stay_on_cpu(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


class _TorchOnCpu:
    """`torch`, except that the tensor factories put `device="cuda"` tensors on the CPU."""

    FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __getattr__(self, name: str):
        factory = getattr(torch, name)
        if name not in self.FACTORIES:
            return factory

        def on_cpu(*args, device=None, **kwargs):
            return factory(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return on_cpu


def apply_cpu_shims() -> None:
    """Apply shims 1, 2, 4, 5, 7, 8 and 9 above (idempotent). Raises if CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims is for CPU-only runs; CUDA is available on this machine")
    if _applied:
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _no_sync
    torch.cuda.current_stream = torch.cpu.current_stream
    torch.Tensor.cuda = _stay_on_cpu
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    mcore_random._get_cuda_rng_state = mcore_random._set_cuda_rng_state = _no_cuda_rng_state
    for module in (schedules, optimizer, clip_grads, mcore_utils):
        module.torch = _TorchOnCpu()
    _applied = True
