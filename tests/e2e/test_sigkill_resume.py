"""Fault injection with real kills: a training process is SIGKILLed at a chosen point of saving a
checkpoint (nothing after that point runs, no handler, no flush), then the same command is run
again; it resumes from step 2. The resumed run must end bit-identical to a run that was never killed: the same final
weights and the same metrics for every step.

Nothing here waits on time: the patched save kills its own process when the run reaches that point,
however slow the machine, and every run starts one compute thread (small_run.py), so the runs compared
sum their floats in the same order whatever the load when each started. An agent run killed in the middle
of a step's episodes: tests/e2e/test_agent_runs.py (beside the uninterrupted run it is compared with)."""

import json
import signal
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from small_run import SMALL_MODEL, train_in_child

pytestmark = pytest.mark.slow
OVERRIDES = SMALL_MODEL + ["rollout.max_response_length=12", "trainer.total_steps=4", "trainer.save_every=2",
                           "trainer.tensorboard=false", "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]

# Patches applied in the child before training: each kills the process at one point of a save.
KILL_POINTS = {
    # saving the final step 4: the trainer state is in the temporary directory, the weights are not
    "mid_save": "import aligner_ext.trainer.checkpoint as c\n"
                "real = c.save_weights\n"
                "def save_weights(model, path):\n"
                "    if '.step_4.tmp' in str(path):\n"
                "        kill()\n"
                "    real(model, path)\n"
                "c.save_weights = save_weights\n",
    # step_2 is renamed into place, the `latest` pointer is not written (there was none before)
    "after_rename": "import aligner_ext.trainer.checkpoint as c\n"
                    "real = c._write_text_atomically\n"
                    "def write(path, text):\n"
                    "    if path.name == c.LATEST and text == 'step_2':\n"
                    "        kill()\n"
                    "    real(path, text)\n"
                    "c._write_text_atomically = write\n",
}


def run(output_dir: Path, name: str, patch: str = "") -> subprocess.CompletedProcess:
    return train_in_child([*OVERRIDES, f"trainer.output_dir={output_dir}", f"trainer.run_name={name}"], patch)


def metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    directory = tmp_path_factory.mktemp("straight")
    finished = run(directory, "run")
    assert finished.returncode == 0, finished.stderr[-2000:]
    return directory / "run"


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_run_killed_while_checkpointing_resumes_to_the_same_result(tmp_path, straight, point):
    killed = run(tmp_path, "run", KILL_POINTS[point])
    assert killed.returncode == -signal.SIGKILL
    resumed = run(tmp_path, "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step_2 (step 2)" in resumed.stderr
    final, reference = tmp_path / "run" / "hf_model", straight / "hf_model"
    ours, theirs = load_file(str(final / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[key].equal(theirs[key]) for key in ours)
    assert metrics(tmp_path / "run") == metrics(straight)
