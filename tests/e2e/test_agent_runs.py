"""Agent episodes end to end on the embedded model (algorithm.experience_maker=agent_episodes), training
LoRA adapters: a two-turn environment with feedback, through the loop, the trainer and the held-out
evaluation; a run stopped after a checkpoint resumes to the same weights and metrics; the same run
under torchrun in two processes plays the same episodes, each exactly once, split between the two, and
reports the same metrics. (Full-parameter training of agent episodes, and tensor parallelism:
tests/megatron/test_megatron_agent_episodes.py.)"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from tests.e2e.small_run import SMALL_MODEL
from tests.processes import torchrun

pytestmark = pytest.mark.slow

E2E = Path(__file__).resolve().parent  # e2e_environments, e2e_rewards (reward workers too)
AGENT = ["algorithm.experience_maker=agent_episodes", "agents.environment=e2e_environments.Recorded",
         "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256", "rollout.max_response_length=24",
         "trainer.tensorboard=false", "+reward.sources.arithmetic=e2e_rewards.digit_fraction",
         "trainer.total_steps=3", "trainer.save_every=1",
         "policy.lora.rank=4", "policy.lora.alpha=8", "policy.optim.lr=1e-3"]


def records(path):
    """metrics.jsonl without wall-clock values."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith("_seconds")} for r in rows]


def episode_log(directory: Path) -> list[str]:
    """The model turns `e2e_environments.Recorded` wrote to `directory` (its E2E_EPISODE_LOG), by rank."""
    return [path.read_text().splitlines() for path in sorted(directory.glob("rank*.jsonl"))]


def played(tmp_path: Path, run_name: str, monkeypatch, processes: int = 0):
    """Run `run_name` under `tmp_path` in this process, or under torchrun in `processes`; its episode log."""
    log = tmp_path / f"{run_name}_episodes"
    log.mkdir()
    monkeypatch.setenv("E2E_EPISODE_LOG", str(log))
    overrides = SMALL_MODEL + AGENT + [f"trainer.output_dir={tmp_path}", f"trainer.run_name={run_name}"]
    if processes:
        torchrun(["-m", "aligner_ext", "train", *overrides], processes=processes, pythonpath=(str(E2E),))
        return None, episode_log(log)
    monkeypatch.syspath_prepend(str(E2E))
    return train(load_config("base", overrides)), episode_log(log)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Run `a` in this process: its directory, summary and episode log."""
    tmp_path = tmp_path_factory.mktemp("agent_runs")
    with pytest.MonkeyPatch.context() as monkeypatch:
        summary, log = played(tmp_path, "a", monkeypatch)
    return tmp_path, summary, log


def test_an_agent_run_trains_on_sampled_tokens_only_reports_its_episodes_and_resumes(one_process, monkeypatch):
    tmp_path, summary, _ = one_process
    metrics = records(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]
    step = metrics[1]
    # 4 prompts x 4 episodes of 1 or 2 turns; a wrong first answer is retried once
    assert step["batch/num_samples"] == 16
    assert 1 <= step["agent/turns"] <= 2 and step["agent/history_rewrites"] == 0
    assert step["agent/retries"] + step["agent/end_done"] == pytest.approx(step["agent/turns"])  # each turn: wrong, or done
    assert step["agent/end_done"] + step["agent/end_max_turns"] + step["agent/end_max_total_tokens"] == 1
    # the engine's log-probs are compared on sampled tokens only: feedback tokens have none
    assert step["rollout/logprob_diff_max"] < 1e-4
    for record in (metrics[0], metrics[3]):
        assert record["val/num_prompts"] == 8 and "val/agent/turns" in record
    assert "agent/turns" in summary.run_means

    # the same run stopped after its step-2 checkpoint
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_3")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_2")
    played(tmp_path, "b", monkeypatch)
    assert records(tmp_path / "b" / "metrics.jsonl") == metrics
    weights_a = load_file(str(tmp_path / "a" / "checkpoints" / "step_3" / "adapters.safetensors"))
    weights_b = load_file(str(tmp_path / "b" / "checkpoints" / "step_3" / "adapters.safetensors"))
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=0, atol=0)
    before = load_file(str(tmp_path / "a" / "checkpoints" / "step_2" / "adapters.safetensors"))
    assert any(not torch.equal(before[name], weights_a[name]) for name in before)  # step 3 moved the weights


def test_two_processes_play_the_one_process_episodes_once_each_and_report_the_same_metrics(one_process, tmp_path,
                                                                                          monkeypatch):
    directory, _, (alone,) = one_process
    _, (rank0, rank1) = played(tmp_path, "a", monkeypatch, processes=2)
    # every model turn of the 3 steps' and the held-out evaluations' episodes, once, on one rank or the other
    assert sorted(rank0 + rank1) == sorted(alone)
    assert rank0 and rank1
    assert records(tmp_path / "a" / "metrics.jsonl") == records(directory / "a" / "metrics.jsonl")
