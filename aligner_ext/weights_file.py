"""A model's weights as one safetensors file, written and read in place: what checkpoints
(trainer/checkpoint.py) and weight pushes to generation servers (generation/remote.py, serving/) use."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

METADATA = {"format": "pt"}  # what transformers writes into a weights file's header


def tied_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names under which one same tensor appears (tied embeddings), groups of two or more."""
    groups: dict[tuple, list[str]] = {}
    for name, value in state.items():
        groups.setdefault((value.data_ptr(), tuple(value.shape), value.stride(), value.dtype), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """The model's weights as safetensors, a tied tensor once. Parameters that view one shared buffer
    (the rollout engine's fused projections) are saved as they are: safetensors' `save_model`
    refuses any storage that no single tensor covers."""
    save_state(model.state_dict(), path)


def save_state(state: dict[str, torch.Tensor], path: Path) -> None:
    """`save_weights` of a state dict (a merged one: aligner_ext/adapters.py)."""
    save_file(_untied(state), str(path), metadata=METADATA)


def state_file_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """The bytes `save_state` writes, made in memory (a checkpoint saved in the background, trainer/checkpoint.py)."""
    return save(_untied(state), metadata=METADATA)


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `state` a weights file holds: a tied tensor once, each contiguous."""
    duplicates = {name for names in tied_groups(state) for name in names[1:]}
    return {name: value.detach().contiguous() for name, value in state.items() if name not in duplicates}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors `save_state` writes from `state` (a tied tensor once), headers left out."""
    duplicates = {name for names in tied_groups(state) for name in names[1:]}
    return sum(value.numel() * value.element_size() for name, value in state.items() if name not in duplicates)


def load_weights(model: torch.nn.Module, path: Path) -> tuple[list[str], list[str]]:
    """Load safetensors weights into `model` in place; (missing, unexpected) names, a tied tensor
    counted as present when the file holds it under any of its names (files from `save_model` too)."""
    loaded = load_file(str(path), device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    covered = {name for names in tied_groups(model.state_dict()) if set(names) & loaded.keys() for name in names}
    return [name for name in missing if name not in covered], list(unexpected)
