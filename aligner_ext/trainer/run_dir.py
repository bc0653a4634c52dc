"""A run directory belongs to one run.

`claim_run_dir` runs before anything is written into `<output_dir>/<run_name>`:
- an empty or absent directory starts a fresh run (as does one holding only the warmed embedded model,
  which `aligner-ext serve` writes when it serves that model);
- `trainer.resume=true` (the default) continues the run the directory holds only if what defines a
  run (`RUN_IDENTITY`: the algorithm and its plug-ins, the variant switches, the task or data files,
  the model and its tokenizer) matches the config the directory was started with; otherwise it
  refuses, naming the differing keys. It refuses too when the newest checkpoint is past
  `trainer.total_steps` (a later checkpoint would be numbered below it). A run that has finished
  (`summary.json` written at the step of its newest checkpoint, `trainer.total_steps`) is reported,
  not run again, so its outputs are never overwritten; the settings this config changes since the run
  started are named as not applied;
- `trainer.resume=false` moves the directory aside (`<run_name>.moved-<time>`, never deleted) and
  starts fresh.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from aligner_ext.config import RunConfig, changed_settings
from aligner_ext.distributed import barrier, is_main_process
from aligner_ext.errors import ConfigError
from aligner_ext.trainer.checkpoint import Checkpointer

logger = logging.getLogger(__name__)

# Settings that define a run (a key or a section prefix ending in "."). The model section covers the
# checkpoint path (and so its tokenizer) and the embedded model's size and warm-up.
RUN_IDENTITY = ("algorithm.", "model.", "data.train_files", "data.val_files", "data.builtin_task",
                "dynamic_sampling.enabled", "graded_prompt.enabled", "cpo.wrap_method")
SAVED_CONFIG = "config.yaml"  # the run's config, written once the claim passes
SUMMARY = "summary.json"  # written at the end of a run
EXPORTED_MODEL = "hf_model"  # the final policy as an HF checkpoint (trainer.export_hf)
EMBEDDED_MODEL = "base_model"  # the warmed embedded model (trainer/build.py), which `serve` may write before a run


class RunDirectoryTaken(ConfigError):
    """The run directory holds another run, or a run this config cannot continue (the message says how
    to start a fresh one)."""


@dataclass
class RunStart:
    """How a run starts in its directory: `describe` for the start-up log; `finished`: the directory
    holds this run, complete (nothing to train or write)."""

    describe: str
    finished: bool = False


def claim_run_dir(cfg: RunConfig, run_dir: Path, checkpointer: Checkpointer) -> RunStart:
    """Check that this config may write into `run_dir` (module docstring), moving it aside for
    `trainer.resume=false`. Collective under torchrun."""
    occupied = run_dir.is_dir() and any(path.name != EMBEDDED_MODEL for path in run_dir.iterdir())
    # every rank has looked before the main one moves the directory aside or, once this returns, writes
    # into it: a rank that looked later would take the run for a resumed one and wait in other collectives
    barrier()
    if occupied and not cfg.trainer.resume:
        aside = run_dir.with_name(f"{run_dir.name}.moved-{time.strftime('%Y%m%d-%H%M%S')}")
        if is_main_process():
            os.replace(run_dir, aside)
            logger.warning("trainer.resume=false: moved the previous %s aside to %s", run_dir, aside)
        barrier()
        return RunStart(f"fresh (the previous run moved to {aside})")
    if not occupied:
        return RunStart("fresh")
    fresh_hint = (f"give this run its own trainer.run_name, or set trainer.resume=false to move {run_dir} aside "
                  "and start fresh")
    saved = run_dir / SAVED_CONFIG
    if not saved.is_file():
        raise RunDirectoryTaken(f"{run_dir} is not empty and holds no {SAVED_CONFIG} of a run: {fresh_hint}")
    differences = changed_settings(saved.read_text(encoding="utf-8"), cfg, among=RUN_IDENTITY)
    if differences:
        raise RunDirectoryTaken(f"{run_dir} holds another run ({'; '.join(differences)}): {fresh_hint}")
    latest = checkpointer.latest()
    if latest is None:
        return RunStart("fresh (no checkpoint to resume in the run directory)")
    step = int(latest.name.split("_")[1])
    total = cfg.trainer.total_steps
    if step > total:
        raise RunDirectoryTaken(f"{run_dir}: its checkpoint of step {step} is past trainer.total_steps={total}; "
                                f"raise trainer.total_steps to continue it, or {fresh_hint}")
    if step == total and finished_at(run_dir) == step:
        unapplied = changed_settings(saved.read_text(encoding="utf-8"), cfg)
        return RunStart(f"finished at step {step}, nothing to do"
                        + (f"; the changed settings were not applied ({'; '.join(unapplied)})" if unapplied else "")
                        + f" (raise trainer.total_steps to train it further, or {fresh_hint})", finished=True)
    return RunStart(f"resumed from step {step} ({latest})")


def finished_at(run_dir: Path) -> int | None:
    """The step the run's summary was written at (its end), or None if it has none."""
    try:
        return json.loads((run_dir / SUMMARY).read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None


def trained_model(output_dir: Path, run_name: str | None) -> Path | None:
    """The final policy (`hf_model/`) of run `run_name` under `output_dir`, or with no name the newest
    one there; None if there is none (what `aligner-ext serve` serves when model.path is unset)."""
    if run_name is not None:
        exported = output_dir / run_name / EXPORTED_MODEL
        return exported if (exported / "config.json").is_file() else None
    exported = [path.parent for path in output_dir.glob(f"*/{EXPORTED_MODEL}/config.json")]
    return max(exported, key=lambda path: path.stat().st_mtime, default=None)
