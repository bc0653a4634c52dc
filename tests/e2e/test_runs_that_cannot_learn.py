"""Runs that cannot learn say so: each of six ways a run trains nothing (and used to exit 0 without a
word) ends with one warning in the log, repeated in summary.json and the printed summary, naming the
cause its metrics show (trainer/no_learning.py); a healthy run says nothing."""

import json
import logging
from pathlib import Path

import pytest

from aligner_ext.cli import main
from aligner_ext.trainer.no_learning import CAUSES, CONSTANT, FALLBACKS, IDENTICAL, ZERO_LR
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

DENSE = "+reward.sources.arithmetic=e2e_rewards.digit_fraction"  # the share of digits: rewards vary in every group


def rows_file(path: Path, content: str, source: str, truth: str) -> Path:
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": content.format(i=i)}],
                                        "data_source": source, "reward_model": {"ground_truth": truth}}) + "\n"
                            for i in range(16)))
    return path


CASES = {  # name -> (overrides, given the test's directory; the cause the warning names)
    "zero learning rate": (lambda tmp: ["policy.optim.lr=0", DENSE], ZERO_LR),
    "a reward that returns one value": (lambda tmp: ["+reward.sources.arithmetic=e2e_rewards.always_wrong"], CONSTANT),
    "a temperature too low to vary": (lambda tmp: ["rollout.temperature=1e-5", DENSE],
                                      IDENTICAL.format(temperature=1e-05)),
    "empty ground truths under an exact match": (lambda tmp: [
        f"data.train_files=[{rows_file(tmp / 'train.jsonl', 'Name a colour ({i})', 'short_qa', '')}]",
        "data.val_files=[]"], CONSTANT),
    "empty prompts": (lambda tmp: [f"data.train_files=[{rows_file(tmp / 'train.jsonl', '', 'arithmetic', '4')}]",
                                   "data.val_files=[]"], CONSTANT),
    "a reward that always raises": (lambda tmp: ["+reward.sources.arithmetic=e2e_rewards.always_raises"], FALLBACKS),
}


def run(tmp_path, monkeypatch, capsys, caplog, extra: list[str]) -> tuple[list[str], dict, list[str]]:
    """Train 3 steps through the CLI: (the detector's log lines, summary.json, the printed lines)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # reward workers import e2e_rewards
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    with caplog.at_level(logging.WARNING, logger="aligner_ext.trainer.no_learning"):
        assert main(["train", *SMALL_MODEL, "rollout.max_response_length=12", "trainer.total_steps=3",
                     "trainer.tensorboard=false", "trainer.export_hf=false", f"trainer.output_dir={tmp_path}",
                     "trainer.run_name=run", *extra]) == 0
    logged = [record.getMessage() for record in caplog.records if record.name == "aligner_ext.trainer.no_learning"]
    return logged, json.loads((tmp_path / "run" / "summary.json").read_text()), capsys.readouterr().out.splitlines()


def causes_in(line: str) -> list[str]:
    return [cause for cause in (c.format(temperature=1e-05) for c in CAUSES) if cause in line]


@pytest.mark.parametrize("case", CASES)
def test_a_run_that_cannot_learn_warns_in_the_log_and_the_summary(case, tmp_path, monkeypatch, capsys, caplog):
    overrides, cause = CASES[case]
    logged, summary, printed = run(tmp_path, monkeypatch, capsys, caplog, overrides(tmp_path))
    stuck = [line for line in logged if line.startswith("steps 1-3: the policy could not learn for 3 steps in a row")]
    assert len(stuck) == 1 and causes_in(stuck[0]) == [cause], logged
    found = summary["warnings"][0]
    assert found.startswith("the policy could not learn in 3 of 3 steps") and causes_in(found) == [cause]
    assert f"warning: {found}" in printed
    assert summary["reward_fallback_fraction"] == (1.0 if cause == FALLBACKS else 0.0)
    if cause.startswith("every group's samples were token-identical"):  # also flagged at once, and in the summary
        assert logged[0].startswith("step 1: every group's samples were token-identical although "
                                    "rollout.temperature=1e-05 samples")
        assert summary["warnings"][1].endswith("at 3 of 3 steps (first: step 1)")
    else:
        assert len(logged) == 1 and len(summary["warnings"]) == 1


def test_a_run_that_learns_says_nothing(tmp_path, monkeypatch, capsys, caplog):
    logged, summary, printed = run(tmp_path, monkeypatch, capsys, caplog, [DENSE])
    assert logged == [] and summary["warnings"] == [] and summary["reward_fallback_fraction"] == 0.0
    assert not any(line.startswith("warning:") for line in printed)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/identical_group_fraction"] for r in records if r["step"] > 0] == [0.0, 0.0, 0.0]


def test_the_megatron_backend_reports_what_the_detector_reads(tmp_path):
    """TP=2 on CPU (gloo), lr=0 with rewards that vary: the same metric names reach the detector, and
    the warning is one line of the main process, not one per rank."""
    pytest.importorskip("megatron.core")
    import os
    import subprocess
    import sys

    e2e = Path(__file__).parent
    overrides = SMALL_MODEL + ["model.tiny.num_kv_heads=2", "rollout.max_response_length=12", "trainer.tensorboard=false",
                               DENSE, "policy.backend=megatron", "policy.tensor_model_parallel_size=2",
                               "policy.dtype=float32", "trainer.total_steps=2", "trainer.no_learning_steps=2",
                               "policy.optim.lr=0", "trainer.export_hf=false", f"trainer.output_dir={tmp_path}",
                               "trainer.run_name=run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(e2e))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", "-m", "aligner_ext", "train", *overrides],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    logged = [line for line in done.stderr.splitlines() if "aligner_ext.trainer.no_learning" in line]
    assert len(logged) == 1 and "[rank 0]" in logged[0] and causes_in(logged[0]) == [ZERO_LR]
    warning, = json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"]
    assert warning.startswith("the policy could not learn in 2 of 2 steps") and causes_in(warning) == [ZERO_LR]
