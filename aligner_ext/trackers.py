"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow, each off by default and imported
only when switched on (`trainer.wandb.enabled`, `trainer.mlflow.enabled`; extras `wandb`, `mlflow`).

A tracker receives the resolved config when the run starts, every step's scalars (the same record as
metrics.jsonl, non-finite values left out), the end-of-run plot, and is closed at the end. Only the
main process tracks. W&B resumes the same run when a run directory is resumed (its id is derived from
the run directory); MLflow starts a new run each time, named after the run.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from aligner_ext.errors import ConfigError
from aligner_ext.rules import choice


@dataclass
class WandbConfig:
    """Weights & Biases (extra `wandb`)."""

    enabled: bool = False  # log to W&B (imports wandb)
    project: str = "aligner-ext"  # W&B project
    entity: str | None = None  # W&B team or user; unset: the logged-in default
    run_name: str | None = None  # unset: trainer.run_name
    tags: list[str] = field(default_factory=list)  # run tags
    mode: str = choice("online", "online", "offline", "disabled")  # online | offline (sync later with `wandb sync`) | disabled


@dataclass
class MlflowConfig:
    """MLflow (extra `mlflow`)."""

    enabled: bool = False  # log to MLflow (imports mlflow)
    tracking_uri: str | None = None  # unset: MLflow's default (MLFLOW_TRACKING_URI or ./mlruns)
    experiment: str = "aligner-ext"  # experiment name
    run_name: str | None = None  # unset: trainer.run_name
    tags: dict[str, str] = field(default_factory=dict)  # run tags


def _import(module: str, option: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{option}=true needs {module}: pip install 'aligner_ext[{module}]' ({err})") from err


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items() if value is not None and math.isfinite(float(value))}


class WandbTracker:
    def __init__(self, cfg: WandbConfig, run_name: str, run_dir: Path, config: dict):
        wandb = _import("wandb", "trainer.wandb.enabled")
        self._image = wandb.Image
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]  # a resumed run continues it
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name or run_name, tags=cfg.tags,
                              mode=cfg.mode, dir=str(run_dir), id=run_id, resume="allow", config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def log_file(self, path: Path) -> None:
        self.run.log({f"plots/{path.stem}": self._image(str(path))})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg: MlflowConfig, run_name: str, settings: dict):
        self.mlflow = _import("mlflow", "trainer.mlflow.enabled")
        if cfg.tracking_uri:
            self.mlflow.set_tracking_uri(cfg.tracking_uri)
        self.mlflow.set_experiment(cfg.experiment)
        self.mlflow.start_run(run_name=cfg.run_name or run_name, tags=dict(cfg.tags))
        self.mlflow.log_params({key: str(value)[:500] for key, value in settings.items()})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(_finite(metrics), step=step)

    def log_file(self, path: Path) -> None:
        self.mlflow.log_artifact(str(path))

    def close(self) -> None:
        self.mlflow.end_run()


def build_trackers(wandb: WandbConfig, mlflow: MlflowConfig, run_name: str, run_dir: Path, config: dict,
                   settings: dict) -> list:
    """The trackers switched on (none by default); `config` nested, `settings` the same as {dotted key: value}."""
    trackers = []
    if wandb.enabled:
        trackers.append(WandbTracker(wandb, run_name, run_dir, config))
    if mlflow.enabled:
        trackers.append(MlflowTracker(mlflow, run_name, settings))
    return trackers
