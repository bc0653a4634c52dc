"""A run directory belongs to one run (trainer/run_dir.py): another run's command is refused before
it writes anything, so the first run's files stay byte-identical; a finished run is not re-run; an
explicit trainer.resume=false moves the old directory aside; variants get their own directory; under
torchrun every rank claims the directory before the main process writes into it."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner_ext.cli import main
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

RUN = [*SMALL_MODEL, "trainer.total_steps=2", "trainer.save_every=1", "trainer.tensorboard=false",
       "trainer.eval.every=0"]


def fingerprint(directory):
    """{relative path: sha256} of every file under `directory`."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def refused(capsys, command, overrides) -> str:
    with pytest.raises(SystemExit) as stopped:
        main([command, *overrides])
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    return stderr.rstrip("\n").split("\n")[-1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished two-step GRPO demo run in runs/demo, and its files' fingerprint."""
    output = tmp_path_factory.mktemp("runs")
    assert main(["demo", *RUN, f"trainer.output_dir={output}"]) == 0
    run_dir = output / "demo"
    assert (run_dir / "summary.json").is_file() and (run_dir / "checkpoints" / "step_2").is_dir()
    return output, run_dir, fingerprint(run_dir)


@pytest.mark.parametrize("variant, differing", [
    ("dapo", "dynamic_sampling.enabled: False -> True"),
    ("mtpo", "algorithm.experience_maker: group_sampling -> two_round"),
    ("cpo", "algorithm.adv_estimator: grpo -> cpo"),
])
def test_another_variant_in_the_same_directory_is_refused_and_writes_nothing(finished_run, capsys, variant,
                                                                               differing):
    output, run_dir, before = finished_run
    mtpo_sizes = ["rollout.n=4", "mtpo.num_answer_generations=2", "mtpo.num_confidence_generations=2",
                  "mtpo.max_answer_length=16", "mtpo.max_confidence_length=16"] if variant == "mtpo" else []
    error = refused(capsys, "demo", [f"+variant={variant}", *RUN, *mtpo_sizes, "trainer.total_steps=3",
                                     f"trainer.output_dir={output}", "trainer.run_name=demo"])
    assert f"{run_dir} holds another run (" in error and differing in error
    assert "trainer.run_name" in error and "trainer.resume=false" in error
    assert fingerprint(run_dir) == before


def test_rerunning_a_finished_run_reports_it_and_writes_nothing(finished_run, capsys, caplog):
    output, run_dir, before = finished_run
    assert main(["demo", *RUN, f"trainer.output_dir={output}"]) == 0
    printed = capsys.readouterr()
    assert "finished at step 2, nothing to do (raise trainer.total_steps" in caplog.text
    saved = json.loads((run_dir / "summary.json").read_text())
    assert f"{100 * saved['accuracy_after']:.1f}" in printed.out  # the finished run's own summary
    assert fingerprint(run_dir) == before


def test_rerunning_a_finished_run_with_changed_settings_names_them_as_not_applied(finished_run, capsys, caplog):
    output, run_dir, before = finished_run
    assert main(["demo", *RUN, f"trainer.output_dir={output}", "policy.optim.lr=2e-5", "rollout.temperature=0.5"]) == 0
    assert ("finished at step 2, nothing to do; the changed settings were not applied (policy.optim.lr: 5e-05 -> "
            "2e-05; rollout.temperature: 1.0 -> 0.5)") in caplog.text
    assert fingerprint(run_dir) == before


def test_asking_fewer_steps_than_the_checkpoint_is_refused(finished_run, capsys):
    output, run_dir, before = finished_run
    error = refused(capsys, "demo", [*RUN, "trainer.total_steps=1", f"trainer.output_dir={output}"])
    assert "its checkpoint of step 2 is past trainer.total_steps=1" in error
    assert fingerprint(run_dir) == before


def test_a_variant_demo_gets_its_own_directory(finished_run, tmp_path):
    output, run_dir, before = finished_run
    assert main(["demo", "+variant=dapo", *RUN, "trainer.total_steps=1", f"trainer.output_dir={output}"]) == 0
    assert (output / "demo_dapo" / "summary.json").is_file()
    assert fingerprint(run_dir) == before


def test_resume_false_moves_the_old_run_aside_and_starts_fresh(tmp_path):
    assert main(["demo", *RUN, "trainer.total_steps=1", f"trainer.output_dir={tmp_path}"]) == 0
    first = fingerprint(tmp_path / "demo")
    assert main(["demo", *RUN, "trainer.total_steps=1", "trainer.resume=false", f"trainer.output_dir={tmp_path}"]) == 0
    moved = [path for path in tmp_path.iterdir() if path.name.startswith("demo.moved-")]
    assert len(moved) == 1 and fingerprint(moved[0]) == first
    assert (tmp_path / "demo" / "checkpoints" / "step_1").is_dir()


def test_a_directory_that_holds_no_run_is_not_written_into(tmp_path, capsys):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "notes.txt").write_text("mine")
    error = refused(capsys, "demo", [*RUN, f"trainer.output_dir={tmp_path}"])
    assert "is not empty and holds no config.yaml of a run" in error
    assert sorted(path.name for path in (tmp_path / "demo").iterdir()) == ["notes.txt"]


def test_a_rank_that_claims_the_run_directory_late_sees_it_fresh_too(tmp_path):
    """The main process writes the run's config right after its claim; a rank that had not looked yet
    took the directory for a resumed run and waited in a collective the main process never reached."""
    worker = Path(__file__).with_name("run_dir_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               str(worker), str(tmp_path)]
    done = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
