"""The widths the model computes over, padded to a multiple of 16 so that a new prompt width compiles
no kernel again.

Triton compiles a kernel once per pattern of its integer arguments' divisibility by 16 (and of their
being 1), and Liger's RoPE takes the sequence length, our decode attention (generation/
decode_attention.py) the KV cache's length, as such arguments. So a step whose width turns a multiple
of 16 (with responses of 24 tokens, a prompt of 24 tokens after ones of 25: 48 positions after 49)
compiles them again, seconds in the middle of training (most likely why such a step took 3.4 s
against 0.85 s at 358M on an H200; docs/benchmarks.md). Padded to a multiple of 16, every width has
the one pattern.
torch.compile's own functions need nothing of the kind: they take these dimensions as dynamic from
their first call (models/kernels.py `compiled_on_cuda`, generation/decoder.py `compile_varying`).

Only on a GPU (`PADDED_DEVICE_TYPES`): elsewhere no kernel specialises on a width, and a pad would only
cost compute (the CPU runs and their numbers stay as they were). Where it pads, exactly (no log-prob or
sample changes): the HF backend's padded micro-batches widen
their prompts' left padding, masked out (models/hf.py `padded_to_multiple`); the Megatron backend's
rows end in pads no real token attends to (models/megatron/policy.py); the rollout engine's KV cache
holds positions past every sequence's own, never read (generation/rollout.py); the HF engine
left-pads its prompts, masked out (generation/hf.py). Padding, not marking dimensions dynamic:
Triton's specialisation is not torch.compile's to turn off; it costs at most 15 positions a row. (cuDNN's
attention, which plans per shape whatever the padding, is left out of SDPA instead: models/kernels.py
`attention_without_plans`.)
The HF backend's packed micro-batches are not padded (a tail pad would count as a sequence for a
mixture of experts' routers); their row length follows the response lengths anyway.
"""

import torch

WIDTH_MULTIPLE = 16
PADDED_DEVICE_TYPES = ("cuda",)  # the devices whose kernels specialise on widths (tests add "cpu" to check the pads)


def width_multiple(device: torch.device | str) -> int:
    """What widths computed on `device` are rounded up to: WIDTH_MULTIPLE on a GPU, 1 elsewhere."""
    return WIDTH_MULTIPLE if torch.device(device).type in PADDED_DEVICE_TYPES else 1


def padded_width(width: int, device: torch.device | str) -> int:
    """`width` rounded up to `width_multiple(device)`."""
    return width + -width % width_multiple(device)
