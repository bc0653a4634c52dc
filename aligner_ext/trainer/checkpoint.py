"""Checkpoints: written atomically, resumed exactly.

A checkpoint is `checkpoints/step_<N>/` holding the weights (`model.safetensors`), the tokenizer,
and `trainer_state.pt` (optimizer, LR schedule, prompt-loader position, experience-maker state,
RNG states). It is written under a temporary name and renamed into place only when complete, and
`checkpoints/latest` (a one-line file, itself replaced atomically) names the newest one, so a run
killed mid-save keeps its previous checkpoint.

Multi-process runs (torchrun, aligner_ext/distributed.py): every process writes its own state
(`trainer_state.pt` on rank 0, `trainer_state.rank<r>.pt` on rank r: a sharded policy's optimizer
state differs per rank) into the temporary directory, which the main process created; after a
barrier the main process writes the weights and the tokenizer and renames the directory into place.
A checkpoint resumes only with the world size that wrote it (checked, named in the error).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from aligner_ext.distributed import barrier, is_main_process, rank, world_size

logger = logging.getLogger(__name__)

LATEST = "latest"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def state_file(rank_index: int) -> str:
    """The file holding rank `rank_index`'s trainer state inside a checkpoint."""
    return "trainer_state.pt" if rank_index == 0 else f"trainer_state.rank{rank_index}.pt"


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Checkpointer:
    """Saves and restores the training state under `<run_dir>/checkpoints`."""

    def __init__(self, run_dir: str | Path, keep_last: int):
        self.directory = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.directory / LATEST
        if not pointer.exists():
            return None
        path = self.directory / pointer.read_text(encoding="utf-8").strip()
        moved_aside = self.directory / f".{path.name}.old"
        if is_main_process() and not path.exists() and (moved_aside / "trainer_state.pt").exists():
            os.replace(moved_aside, path)  # a crash while re-saving this step: its previous copy is whole
        barrier()
        if not (path / "trainer_state.pt").exists():
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path

    def save(self, step: int, model: torch.nn.Module, tokenizer, state: dict[str, Any]) -> Path:
        """Write step `step`; `state` holds everything but the weights (optimizer, loader, ...).
        Every process calls this with its own `state`; `model` must hold the same weights on all."""
        final = self.directory / f"step_{step}"
        tmp = self.directory / f".step_{step}.tmp"
        if is_main_process():
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()
        record = {**state, "step": step, "rng": rng_state(), "world_size": world_size()}
        torch.save(record, tmp / state_file(rank()))
        barrier()
        if is_main_process():
            save_model(model, str(tmp / "model.safetensors"))
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
            self._publish(tmp, final)
        barrier()
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename the complete `tmp` into place as `final` and point `latest` at it (main process)."""
        # Re-saving a step (a resumed, finished run) moves the old copy aside first, so some complete
        # copy of the step exists at every moment.
        replaced = self.directory / f".{final.name}.old"
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _write_text_atomically(self.directory / LATEST, final.name)
        shutil.rmtree(replaced, ignore_errors=True)
        self._prune(keep=final)
        logger.info("saved checkpoint %s", final)

    def load(self, path: Path, model: torch.nn.Module) -> dict[str, Any]:
        """Load the weights into `model` and the RNG states; return the rest of the saved state."""
        try:
            missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False,
                                             device=str(model.device))
        except RuntimeError as err:  # a tensor of another shape
            raise RuntimeError(f"checkpoint {path} does not fit the model: {err}") from err
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")
        own = path / state_file(rank())
        if not own.exists():
            raise FileNotFoundError(f"checkpoint {path} has no {own.name}: it was written by fewer processes "
                                    f"than this run's {world_size()}")
        state = torch.load(own, weights_only=False)
        saved_world = state.get("world_size", 1)  # checkpoints of single-process runs before this field
        if saved_world != world_size():
            raise RuntimeError(f"checkpoint {path} was written by {saved_world} process(es); this run has {world_size()}")
        set_rng_state(state["rng"])
        logger.info("resumed from %s (step %d)", path, state["step"])
        return state

    def _prune(self, keep: Path) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(self.directory.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: -self.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
