"""Secrets never reach the run directory, the trackers or the logs: a small run with planted API keys
(serve.api_key given on the command line, generator.remote.api_key read from the environment,
generator.remote.api_key_file in the resumed run) is scanned byte for byte, every file it wrote
(config.yaml, checkpoints, tensorboard events, samples, metrics), what the trackers got and what it
logged; the saved config records only that a key was set, and the run resumes with the key re-read."""

import logging
import sys
from pathlib import Path

import pytest

from aligner_ext.config import load_config
from aligner_ext.secrets import SET
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL
from test_trackers import Recorder, fake_mlflow, fake_wandb

pytestmark = pytest.mark.slow

CLI_SECRET = "sk-planted-on-the-command-line-7f3a"
ENV_SECRET = "sk-planted-in-the-environment-91c2"
FILE_SECRET = "sk-planted-in-a-file-5d0e"
SECRETS = (CLI_SECRET, ENV_SECRET, FILE_SECRET)


def leaks(root: Path) -> list[str]:
    """`path: secret` for every file under `root` whose bytes contain a planted secret."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path}: {secret}" for secret in SECRETS if secret.encode() in data]
    return found


def test_planted_secrets_are_never_written_and_the_run_resumes(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    wandb, mlflow = Recorder(), Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wandb))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mlflow))
    monkeypatch.setenv("PLANTED_REMOTE_KEY", ENV_SECRET)
    run = SMALL_MODEL + [
        "rollout.max_response_length=8", "trainer.tensorboard=true", "trainer.log_samples_every=1",
        "trainer.save_every=1", f"trainer.output_dir={tmp_path / 'runs'}", "trainer.run_name=planted",
        "trainer.wandb.enabled=true", "trainer.wandb.mode=offline", "trainer.mlflow.enabled=true",
        f"trainer.mlflow.tracking_uri=file://{tmp_path / 'mlruns'}", f"serve.api_key={CLI_SECRET}"]
    cfg = load_config("base", run + ["trainer.total_steps=2", "generator.remote.api_key_env=PLANTED_REMOTE_KEY"])
    assert (cfg.serve.api_key, cfg.generator.remote.api_key) == (CLI_SECRET, ENV_SECRET)
    train(cfg)

    key_file = tmp_path / "remote.key"
    key_file.write_text(FILE_SECRET + "\n")
    resumed = load_config("base", run + ["trainer.total_steps=3", f"generator.remote.api_key_file={key_file}"])
    assert resumed.generator.remote.api_key == FILE_SECRET  # re-read: the saved config cannot give it
    summary = train(resumed)
    key_file.unlink()

    run_dir = tmp_path / "runs" / "planted"
    assert summary.steps == 3 and (run_dir / "checkpoints" / "step_3" / "trainer_state.pt").exists()
    assert list((run_dir / "tensorboard").rglob("events.*"))
    assert leaks(tmp_path) == []
    config_yaml = (run_dir / "config.yaml").read_text()
    assert f"api_key: {SET}" in config_yaml and "api_key_file: " + str(key_file) in config_yaml
    tracked = repr(wandb.calls) + repr(mlflow.calls)
    assert SET in tracked and not any(secret in tracked for secret in SECRETS)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "resuming" in logged and not any(secret in logged for secret in SECRETS)
