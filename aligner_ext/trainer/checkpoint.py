"""Checkpoints: written atomically, resumed exactly.

A checkpoint is `checkpoints/step_<N>/` holding the weights (`model.safetensors`), the tokenizer,
and `trainer_state.pt` (optimizer, LR schedule, prompt-loader position, experience-maker state: with
generation ahead, the batches made and not yet trained; RNG states),
and `manifest.json` (every file's size and SHA-256, written last); a policy with LoRA
adapters saves them alone (`adapters.safetensors`) with `base.json`, the path and checksum of the
base model they belong to, and resuming them on another base is refused (models/lora.py). It is written under
a temporary name and renamed into place only when complete, so every `step_<N>` directory is a
complete checkpoint and a run killed mid-save keeps its previous one. A write that fails (disk full, an I/O
error, on any process) removes the temporary directory and stops the run in one line naming the bytes needed
and free (trainer/disk_space.py); the previous checkpoint stays `latest`. `checkpoints/latest` (a
one-line file, itself replaced atomically) names the newest one, but it is only a hint: the newest
complete checkpoint is found from the directories themselves, so a kill between a rename and the
pointer's write loses nothing. On resume the manifest is checked first; a truncated, corrupt or
missing file is named and the previous complete checkpoint is tried. A checkpoint without a
manifest (written before manifests existed, or with its manifest deleted to switch the check off) is
refused unless the user allows it (`trainer.allow_unverified_checkpoint`): the library never leaves
a `step_<N>` directory without one, and pruning renames a checkpoint out of that name before
deleting it. Weights holding NaN or infinity are never saved (the policy's `NonFiniteGuard` skips
the updates that would make them; this is the last fence).

A save in the background (`trainer.async_save`, `background=True`) does not stall training: what the
main process writes is serialised into memory at once (the trainer state as `torch.save` writes it, the
weights as safetensors writes them, the tokenizer's files), so the next step may change the weights
and the RNG, and a writer thread writes those bytes, the manifest, renames the directory into place,
points `latest` at it and prunes; a sharded policy's part is the policy's own background write
(megatron-core's asynchronous save), and the writer thread starts once every process finished it. The
loop asks before it logs each step (`poll`), and the next save (the final one among them, itself in
the foreground) waits for it (`wait`); both are collective. A background write that fails is the same
one line at the first of them, and the previous checkpoint stays `latest`: until the rename the
checkpoint is only the temporary directory, which a kill -9 leaves behind and the next save of that
step removes. A run stopping on an error lets the writer thread finish first (`settled_on_error`).
The price is host memory: one checkpoint's main-process files (and a sharded policy's share on each
process) are held until written.

Multi-process runs (torchrun, aligner_ext/distributed.py): every process runs the same loop, so the
loader, experience-maker and RNG states are the same on every rank, and the main process alone
writes `trainer_state.pt`. What differs between ranks, a sharded policy's weights and optimizer
state, the policy writes itself (`Policy.save_sharded`, every process collectively) into a
subdirectory of the temporary directory, which the main process created; after a barrier the main
process writes its state, the weights and the tokenizer and renames the directory into place.
Every process resumes from `trainer_state.pt`, so the number of processes may change between save
and resume (the Megatron backend reshards its own state: docs/megatron.md).

`trainer_state.pt` is read with `torch.load(weights_only=True)`: tensors, numbers, strings and
containers, plus the library's own record types (`SAFE_TYPES`: a dynamic-sampling surplus batch, the
batches made ahead, the groups carried over).
Nothing else is unpickled, so a checkpoint handed over by someone else cannot run code on resume;
the RNG states are saved as plain numbers for that reason. The Megatron backend's distributed
checkpoint is read the same way (models/megatron/dist_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_bytes

from aligner_ext.adapters import adapter_state, model_is_adapted
from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.distributed import any_process, barrier, is_main_process
from aligner_ext.errors import (CheckpointError, CorruptCheckpoint, UnsafeCheckpoint, UnverifiedCheckpoint,
                                 error_line)
from aligner_ext.experience.base import SampleRequest
from aligner_ext.experience.carry_over import Group
from aligner_ext.experience.graded_prompt import GradedRequest
from aligner_ext.files import attempt_write, failed_write, follow_umask
from aligner_ext.generation.resumable import Partial
from aligner_ext.models import lora
from aligner_ext.models.base import ShardedWrite
from aligner_ext.trainer.disk_space import save_failed
from aligner_ext.weights_file import load_weights, save_weights, state_file_bytes

logger = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
# a save that waits this long for the previous background save's write says that saves outpace the disk
BEHIND_THE_DISK_S = 1.0
WEIGHTS = "model.safetensors"
ADAPTERS = "adapters.safetensors"  # instead of WEIGHTS when the policy trains LoRA adapters
# the classes trainer_state.pt may hold: batches (made ahead, a dynamic-sampling surplus) and carried groups
SAFE_TYPES = (ExperienceBatch, SampleInfo, PromptRow, Group, SampleRequest, GradedRequest, PromptDraw, Partial)


def rng_state() -> dict[str, Any]:
    """The RNG states; on a GPU the current device's (under torchrun each rank's GPU draws as rank 0's)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = (name, keys.tolist(), position, has_gauss, cached_gaussian)  # plain types: no ndarray to unpickle
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_trainer_state(path: Path) -> dict[str, Any]:
    """`trainer_state.pt` unpickled with torch's weights-only loader and `SAFE_TYPES` allowed."""
    with torch.serialization.safe_globals(list(SAFE_TYPES)):
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(f"{path}: refusing to load it, it holds objects other than tensors, numbers, "
                                   f"strings, containers and {', '.join(t.__name__ for t in SAFE_TYPES)} (loading "
                                   f"them could run code); was it written by this library? {error_line(err)}") from err


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_manifest(directory: Path, step: int) -> None:
    """`manifest.json`: size and SHA-256 of every file under `directory`, written (and synced) last."""
    files = {str(path.relative_to(directory)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(directory.rglob("*")) if path.is_file()}
    _write_text_atomically(directory / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def _write_files(tmp: Path, step: int, model: torch.nn.Module | None, adapters: dict[str, torch.Tensor] | None,
                 tokenizer, state: dict[str, Any]) -> None:
    """The main process's part of a checkpoint in `tmp`: the state, the weights (the adapters alone when
    given), the tokenizer, and the manifest last."""
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
    if adapters is not None:
        save_file({name: value.detach().contiguous() for name, value in adapters.items()}, str(tmp / ADAPTERS))
        lora.write_base(model.name_or_path, tmp)
    elif model is not None:
        save_weights(model, tmp / WEIGHTS)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    _write_manifest(tmp, step)
    follow_umask(tmp)


def _files_in_memory(step: int, model: torch.nn.Module | None, adapters: dict[str, torch.Tensor] | None,
                     tokenizer, state: dict[str, Any]) -> dict[str, bytes | memoryview]:
    """What `_write_files` writes before the manifest, as {path in the checkpoint: bytes}: a snapshot of
    this moment that the next step cannot change (a background save)."""
    files: dict[str, bytes | memoryview] = {}
    buffer = io.BytesIO()
    torch.save({**state, "step": step, "rng": rng_state()}, buffer)
    files[STATE_FILE] = buffer.getbuffer()
    if adapters is not None:
        files[ADAPTERS] = safetensors_bytes({name: value.detach().contiguous() for name, value in adapters.items()})
        files[lora.BASE_FILE] = lora.base_json(model.name_or_path).encode()
    elif model is not None:
        files[WEIGHTS] = state_file_bytes(model.state_dict())
    with tempfile.TemporaryDirectory() as directory:  # the tokenizer is in use while the writer runs
        tokenizer.save_pretrained(directory)
        for file in sorted(Path(directory).rglob("*")):
            if file.is_file():
                files[str(Path("tokenizer") / file.relative_to(directory))] = file.read_bytes()
    return files


def _write_from_memory(tmp: Path, step: int, files: dict[str, bytes | memoryview]) -> None:
    """Write `_files_in_memory`'s files into `tmp`, then the manifest (the writer thread)."""
    for name, content in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp / name, "wb") as handle:
            handle.write(content)
    _write_manifest(tmp, step)
    follow_umask(tmp)


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class PendingSave:
    """One background save: the sharded part under way, then the main process's files in memory, written
    by a thread that publishes the checkpoint."""

    def __init__(self, tmp: Path, final: Path):
        self.tmp, self.final = tmp, final
        self.sharded: ShardedWrite | None = None
        self.files: dict[str, bytes | memoryview] = {}
        self.step = int(final.name.split("_")[1])
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what the writer thread raised

    def start_sharded(self, save_sharded: Callable[[Path, bool], ShardedWrite | None], background: bool) -> None:
        self.sharded = save_sharded(self.tmp, background)

    def finish_sharded(self, wait: bool) -> None:
        if self.sharded.finished(wait):
            self.sharded = None

    def abandon_sharded(self) -> None:
        """Let a sharded write that was started end before its directory is removed (its failure is moot)."""
        if self.sharded is not None:
            attempt_write(lambda: self.sharded.finished(wait=True))
            self.sharded = None

    def hold(self, files: dict[str, bytes | memoryview]) -> None:
        self.files = files

    def write(self, publish: Callable[[], None], wait: bool) -> None:
        """Start the writer thread once (main process); `wait`: until it is done. Not a daemon: a run
        that stops on an error still finishes the checkpoint before the process exits."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._write, args=(publish,), name=f"checkpoint-{self.step}")
            self.thread.start()
        if wait:
            self.thread.join()

    def writing(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _write(self, publish: Callable[[], None]) -> None:
        try:
            _write_from_memory(self.tmp, self.step, self.files)
            self.files = {}
            publish()
        except BaseException as err:  # reported by the trainer's thread at its next poll or wait
            shutil.rmtree(self.tmp, ignore_errors=True)  # a full disk is freed at once, not at the report
            self.error = err


class Checkpointer:
    """Saves and restores the training state under `<run_dir>/checkpoints`."""

    def __init__(self, run_dir: str | Path, keep_last: int, allow_unverified: bool = False):
        self.directory = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.allow_unverified = allow_unverified  # trainer.allow_unverified_checkpoint
        self.expected_bytes = 0  # one checkpoint's estimated size (trainer/disk_space.py), named when a save fails
        self.pending: PendingSave | None = None  # a background save under way
        self.warned_behind = False  # the one warning that saves come faster than the disk writes them

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None (`complete()` lists them all)."""
        found = self.complete()
        return found[0] if found else None

    def complete(self) -> list[Path]:
        """Every complete checkpoint (a `step_<N>` directory with its manifest, or an older version's
        with its trainer state), newest first.
        The `latest` pointer is only compared, never trusted: a stale one is reported."""
        if is_main_process():
            for aside in self.directory.glob(".step_*.old"):  # a crash while re-saving a step
                final = self.directory / aside.name[1:].removesuffix(".old")
                if not final.exists() and (aside / STATE_FILE).exists():
                    os.replace(aside, final)  # its previous copy is whole
        barrier()
        # Checkpoints of older versions have no manifest; a `step_<N>` directory exists only once complete.
        found = sorted((path for path in self.directory.glob("step_*")
                        if (path / MANIFEST).exists() or (path / STATE_FILE).exists()),
                       key=lambda path: int(path.name.split("_")[1]), reverse=True)
        pointer = self.directory / LATEST
        named = pointer.read_text(encoding="utf-8").strip() if pointer.exists() else None
        if found and named != found[0].name:
            logger.warning("%s names %s; the newest complete checkpoint is %s", pointer, named, found[0].name)
        return found

    def verify(self, path: Path) -> None:
        """Check every file of checkpoint `path` against its manifest; CorruptCheckpoint names the first
        that is missing, of another size or of another SHA-256. Without a manifest UnverifiedCheckpoint,
        unless `allow_unverified`."""
        if not (path / MANIFEST).exists():
            if not self.allow_unverified:
                raise UnverifiedCheckpoint(
                    f"{path}: no {MANIFEST}, so its files cannot be verified (written before manifests existed, "
                    "or the manifest was deleted); refusing to resume from it: set "
                    "trainer.allow_unverified_checkpoint=true to load it unverified if you trust it")
            logger.warning("%s has no %s: loading it unverified (trainer.allow_unverified_checkpoint)", path, MANIFEST)
            return
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CorruptCheckpoint(f"{path / MANIFEST}: unreadable ({err})") from err
        for name, expected in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CorruptCheckpoint(f"{file}: missing")
            if file.stat().st_size != expected["bytes"]:
                raise CorruptCheckpoint(f"{file}: {file.stat().st_size} bytes, the manifest says {expected['bytes']} "
                                        "(truncated or overwritten)")
            if _sha256(file) != expected["sha256"]:
                raise CorruptCheckpoint(f"{file}: its SHA-256 differs from the manifest's (corrupted)")

    def save(self, step: int, model: torch.nn.Module | None, tokenizer, state: dict[str, Any],
             save_sharded: Callable[[Path, bool], ShardedWrite | None] | None = None,
             background: bool = False) -> Path:
        """Write step `step`; `state` holds everything but the weights (optimizer, loader, ...).
        Every process calls this; the main process's `state` and `model` are written (they must be
        the same on all; no `model.safetensors` when `model` is None: `save_sharded` holds the
        weights), and `save_sharded(directory, background)` runs on every process inside the new
        checkpoint. `background`: return once the files are in memory (module docstring); `wait` or
        `poll` finish the save. Logs how long the loop waited: the stall a save costs a step, and the part
        of it spent waiting for the previous background save's write (once a warning: raise save_every)."""
        started = time.perf_counter()
        previous = self.pending.final.name if self.pending is not None else None
        self.wait()
        behind = time.perf_counter() - started
        final = self.directory / f"step_{step}"
        tmp = self.directory / f".step_{step}.tmp"
        if is_main_process():
            adapted = model is not None and model_is_adapted(model)
            saved = {} if model is None else adapter_state(model) if adapted else model.state_dict()
            poisoned = [name for name, tensor in saved.items()
                        if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
            if poisoned:  # a resume from it could only fail or train on garbage: keep the previous checkpoint
                raise RuntimeError(f"not saving step {step}: non-finite values in {len(poisoned)} weight tensor(s) "
                                   f"({', '.join(poisoned[:3])}); {self.directory / LATEST} still names the last "
                                   "finite checkpoint")
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()
        pending, failure = PendingSave(tmp, final), None
        if save_sharded is not None:
            failure = attempt_write(lambda: pending.start_sharded(save_sharded, background))
        barrier()
        if is_main_process() and failure is None:
            adapters = saved if adapted else None
            failure = attempt_write(lambda: pending.hold(_files_in_memory(step, model, adapters, tokenizer, state))
                                    if background else _write_files(tmp, step, model, adapters, tokenizer, state))
        if any_process(failure is not None):
            pending.abandon_sharded()
            self._give_up(tmp, final, failure)
        if background:
            self.pending = pending
            self.poll()
        else:
            if is_main_process():
                self._publish(tmp, final)
            barrier()
        if is_main_process():
            slow_disk = previous is not None and behind >= BEHIND_THE_DISK_S
            logger.info("checkpoint %s: the loop waited %.2f s%s%s", final.name, time.perf_counter() - started,
                        f" ({behind:.2f} s of them for {previous}'s write)" if slow_disk else "",
                        ", writing it in the background" if background else "")
            if slow_disk and not self.warned_behind:
                self.warned_behind = True
                logger.warning("checkpoint %s waited %.1f s for %s, still being written in the background: saves come "
                               "faster than the disk writes them; raise trainer.save_every (or save the weights alone, "
                               "trainer.save_optimizer=false)", final.name, behind, previous)
        return final

    def poll(self) -> None:
        """Move a background save on without waiting: finish the sharded part if every process has
        written it, start the writer thread, note it done; its failure is one line (collective)."""
        self._advance(wait=False)

    def wait(self) -> None:
        """Wait until a background save is in place (`latest` names it), or stop in its failure's one
        line (collective). Nothing when no save is under way."""
        self._advance(wait=True)

    @contextlib.contextmanager
    def settled_on_error(self) -> Iterator[None]:
        """Around the steps: a run stopping on an error first lets its writer thread finish, so the checkpoint
        whose files were in memory is in place when the error leaves (this process alone, no collective:
        the others may be elsewhere; a sharded part still under way stays unpublished)."""
        try:
            yield
        except BaseException:
            pending = self.pending
            if pending is not None and pending.thread is not None:
                pending.thread.join()
                if pending.error is not None:
                    logger.error("writing checkpoint %s failed too: %s", pending.final, error_line(pending.error))
            raise

    def _advance(self, wait: bool) -> None:
        pending = self.pending
        if pending is None:
            return
        if pending.sharded is not None:
            failure = attempt_write(lambda: pending.finish_sharded(wait))
            if any_process(failure is not None):
                self.pending = None
                self._give_up(pending.tmp, pending.final, failure)
            if pending.sharded is not None:  # every process agrees: the finish check is collective
                return
        if is_main_process():
            pending.write(lambda: self._publish(pending.tmp, pending.final), wait)
        if any_process(is_main_process() and pending.writing()):
            return
        self.pending = None
        error = pending.error if is_main_process() else None
        if any_process(error is not None):
            failure = failed_write(error) if error is not None else None
            if error is not None and failure is None:
                raise error  # a bug keeps its traceback
            self._give_up(pending.tmp, pending.final, failure)

    def _give_up(self, tmp: Path, final: Path, failure: BaseException | None) -> None:
        """A write of the checkpoint failed on some process: remove what was written and stop in one line
        (every process; `failure` is this process's, None where another one failed)."""
        barrier()
        if is_main_process():
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        previous = self.latest()
        kept = (f"{self.directory / LATEST} still names {previous.name}, which a rerun resumes from" if previous
                else "no earlier checkpoint exists, a rerun starts afresh")
        after = (f"{kept}. Free space, lower trainer.keep_last (now {self.keep_last}) or choose another "
                 "trainer.output_dir")
        raise save_failed("checkpoint", final, self.expected_bytes,
                          failure if failure is not None else OSError("a write failed on another process"), after)

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

    def load(self, path: Path, model: torch.nn.Module | None) -> dict[str, Any]:
        """Load the weights into `model` (none when it is None: the policy restores its own from its
        sharded state) and the RNG states; return the rest of the saved state."""
        if model is not None:
            self._load_weights(path, model)
        state = load_trainer_state(path / STATE_FILE)
        set_rng_state(state["rng"])
        logger.info("resumed from %s (step %d)", path, state["step"])
        return state

    @staticmethod
    def _load_weights(path: Path, model: torch.nn.Module) -> None:
        adapted = model_is_adapted(model)
        if adapted != (path / ADAPTERS).exists():
            held, wanted = (WEIGHTS, "adapters (policy.lora.rank > 0)") if adapted else (ADAPTERS, "every weight")
            raise CheckpointError(f"checkpoint {path} holds {held}, this run trains {wanted}: resume with the "
                                  "policy.lora settings it was saved with, or start afresh (trainer.resume=false)")
        file = path / (ADAPTERS if adapted else WEIGHTS)
        try:
            if adapted:
                lora.check_base(model.name_or_path, path)
                lora.load_adapters(model, load_file(str(file), device=str(next(model.parameters()).device)), path)
                return
            missing, unexpected = load_weights(model, file)
        except SafetensorError as err:  # not safetensors: unverified, or replaced and the manifest recomputed
            raise CorruptCheckpoint(f"{file}: unreadable ({err})") from err
        except RuntimeError as err:  # a tensor of another shape
            raise CheckpointError(f"checkpoint {path} does not fit the model: {err}") from err
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")

    def _prune(self, keep: Path) -> None:
        if self.keep_last <= 0:
            return
        for leftover in self.directory.glob(".step_*.deleting"):  # a run killed while pruning
            shutil.rmtree(leftover, ignore_errors=True)
        steps = sorted(self.directory.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: -self.keep_last]:
            if old != keep:  # renamed first: a kill mid-delete must not leave a step_<N> without its manifest
                doomed = self.directory / f".{old.name}.deleting"
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
