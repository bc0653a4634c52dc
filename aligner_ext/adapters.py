"""Low-rank adapters as tensors: what the rollout engine, checkpoints and weight pushes read from a
model that carries LoRA layers (peft's, attached by `models/lora.py`).

A LoRA layer computes `x W^T + b + (x A^T) B^T * alpha / r` with the frozen base weight W [out, in]
and the trained A [r, in], B [out, r]. `add_low_rank` is that second term, op for op as the policy's
LoRA layers compute it (`models/lora.py`: A and B kept in float32 and cast to the activations' dtype
for the products, so a bf16 model's adapter products run on tensor cores and no float32 copy of the
activations is made), so the engine's log-probs equal the training forward's. Merging
(`merged_state`) writes W + B A * alpha / r into new tensors, never into W: the frozen base keeps
its exact values, and switching the adapters off gives it back.

Kept out of `models/` so that the generation engines, which never import the policy backends, can
read the adapters too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

ADAPTER_PREFIX = "lora_"  # peft's parameter names: <layer>.lora_A.<adapter>.weight, <layer>.lora_B...


class LowRank(NamedTuple):
    """One adapter of a linear layer: its output is `(x a^T) b^T * scale`."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float  # alpha / r


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adapter: LowRank | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` plus the adapter's term where there is one (module docstring)."""
    out = F.linear(x, weight, bias)
    return out if adapter is None else add_low_rank(out, x, adapter)


def add_low_rank(out: torch.Tensor, x: torch.Tensor, adapter: LowRank) -> torch.Tensor:
    """`out` (the base product of `x`) plus the adapter's term, computed in `x`'s dtype as the policy's
    LoRA layers compute it (module docstring)."""
    return out + F.linear(F.linear(x, adapter.a.to(x.dtype)), adapter.b.to(x.dtype)) * adapter.scale


def is_adapted(module: torch.nn.Module) -> bool:
    """Whether `module` is a peft LoRA layer with an active adapter (not switched off)."""
    return hasattr(module, "lora_A") and bool(module.active_adapters) and not module.disable_adapters


def adapter_of(module: torch.nn.Module) -> LowRank | None:
    """The active adapter of a peft LoRA layer (its parameters themselves, not copies), or None for a
    plain layer. One adapter per layer: the library attaches one."""
    if not is_adapted(module):
        return None
    name, = module.active_adapters
    return LowRank(module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name])


def model_is_adapted(model: torch.nn.Module) -> bool:
    return any(is_adapted(module) for module in model.modules())


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by their names in `model.state_dict()`: what a checkpoint holds."""
    return {name: value for name, value in model.state_dict().items() if f".{ADAPTER_PREFIX}" in name}


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `model` as the model without adapters names them, each adapted weight replaced by
    a new tensor W + B A * scale (computed in at least float32, in W's dtype); a model without adapters: its
    `state_dict()`. What the HF export and generation servers get."""
    state = model.state_dict()
    if not model_is_adapted(model):
        return state
    merged = {}
    for prefix, module in model.named_modules():
        adapter = adapter_of(module)
        if adapter is not None:
            weight = module.base_layer.weight
            exact = torch.promote_types(weight.dtype, torch.float32)
            delta = (adapter.b.to(exact) @ adapter.a.to(exact)) * adapter.scale
            merged[f"{prefix}.weight"] = (weight.to(exact) + delta).to(weight.dtype)
    out = {}
    for name, value in state.items():
        if f".{ADAPTER_PREFIX}" in name:
            continue
        name = name.replace(".base_layer.", ".")
        out[name] = merged.get(name, value)
    return out


def merged_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`model.named_parameters()` as the model without adapters has them, merged where adapted
    (`merged_state`): what a weight push to generation servers broadcasts."""
    if not model_is_adapted(model):
        return list(model.named_parameters())
    state = merged_state(model)
    return [(name.replace(".base_layer.", "."), state[name.replace(".base_layer.", ".")])
            for name, _ in model.named_parameters() if f".{ADAPTER_PREFIX}" not in name]
