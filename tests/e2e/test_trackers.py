"""W&B and MLflow trackers: off by default and never imported then; on, they get the config, every
step's scalars (as metrics.jsonl has them) and the end-of-run plot, through fake modules."""

import json
import subprocess
import sys
import types

import pytest

from aligner_ext.config import load_config
from aligner_ext.errors import ConfigError
from aligner_ext.trackers import MlflowConfig, WandbConfig, build_trackers
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL


class Recorder:
    """Records every call made on it (attribute name, args, kwargs); returns `returns[name]`."""

    def __init__(self, **returns):
        self.calls, self.returns = [], returns

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self.returns.get(name)
        return call

    def named(self, name):
        return [(args, kwargs) for called, args, kwargs in self.calls if called == name]


def fake_wandb(run):
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: (run.calls.append(("init", (), kwargs)), run)[1]
    module.Image = lambda path: ("image", path)
    return module


def fake_mlflow(recorder):
    module = types.ModuleType("mlflow")
    for name in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "log_artifact", "end_run"):
        setattr(module, name, getattr(recorder, name))
    return module


@pytest.mark.slow
def test_both_trackers_receive_config_every_step_and_the_plot(tmp_path, monkeypatch):
    run, mlflow = Recorder(), Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(run))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mlflow))
    cfg = load_config("base", SMALL_MODEL + [
        "trainer.total_steps=2", "rollout.max_response_length=8", "trainer.tensorboard=false",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=tracked", "trainer.wandb.enabled=true",
        "trainer.wandb.mode=offline", "trainer.mlflow.enabled=true", "trainer.mlflow.tracking_uri=file:///tmp/x",
        "+trainer.mlflow.tags.team=rl"])
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "tracked" / "metrics.jsonl").read_text().splitlines()]
    finite = [{k: v for k, v in r.items() if k != "step" and v is not None} for r in records]

    (init_kwargs,) = [kwargs for _, kwargs in run.named("init")]
    assert init_kwargs["name"] == "tracked" and init_kwargs["mode"] == "offline"
    assert init_kwargs["config"]["trainer"]["total_steps"] == 2
    logged = [(kwargs["step"], args[0]) for args, kwargs in run.named("log") if "step" in kwargs]
    assert logged == [(r["step"], f) for r, f in zip(records, finite)]
    assert run.named("log")[-1][0][0] == {"plots/reward_accuracy": ("image", str(tmp_path / "tracked" / "reward_accuracy.png"))}
    assert len(run.named("finish")) == 1

    assert mlflow.named("set_tracking_uri") == [(("file:///tmp/x",), {})]
    assert mlflow.named("start_run") == [((), {"run_name": "tracked", "tags": {"team": "rl"}})]
    (params,) = [args[0] for args, _ in mlflow.named("log_params")]
    assert params["trainer.total_steps"] == "2" and params["rollout.n"] == "4"
    assert [(kwargs["step"], args[0]) for args, kwargs in mlflow.named("log_metrics")] == [
        (r["step"], f) for r, f in zip(records, finite)]
    assert mlflow.named("log_artifact") == [((str(tmp_path / "tracked" / "reward_accuracy.png"),), {})]
    assert [name for name, _, _ in mlflow.calls][-1] == "end_run"


def test_off_by_default_and_never_imported():
    code = ("import sys; from aligner_ext.config import load_config; import aligner_ext.trainer.loop; "
            "from aligner_ext.trackers import build_trackers; c = load_config('base', []); "
            "assert build_trackers(c.trainer.wandb, c.trainer.mlflow, 'r', None, {}, {}) == []; "
            "assert 'wandb' not in sys.modules and 'mlflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_chosen_tracker_that_is_not_installed_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"trainer.wandb.enabled=true needs wandb: pip install 'aligner_ext\[wandb\]'"):
        build_trackers(WandbConfig(enabled=True), MlflowConfig(), "r", tmp_path, {}, {})
