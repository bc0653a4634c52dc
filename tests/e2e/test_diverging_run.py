"""Fault injection: a run whose loss turns NaN from its third step on. The NaN updates are skipped
and counted, the run stops with one line and exit status 2 after `max_nonfinite_in_a_row`, and the
checkpoint left behind holds the last finite weights, from which a resume works. A learning rate of
1e30, whose weights stay finite, is stopped by the divergence guard without a checkpoint of them, on
the HF and the Megatron backend."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aligner_ext.cli import main
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow


def test_a_diverging_run_stops_cleanly_and_keeps_a_finite_checkpoint(tmp_path, monkeypatch, capsys):
    honest = ClippedPGLoss.__call__
    calls = []

    def nan_from_the_third_update(self, logprobs, batch, counts):
        calls.append(1)
        value, metrics = honest(self, logprobs, batch, counts)
        return (value * math.nan if len(calls) > 2 else value), metrics

    monkeypatch.setattr(ClippedPGLoss, "__call__", nan_from_the_third_update)
    overrides = SMALL_MODEL + ["trainer.total_steps=6", "trainer.save_every=1", "trainer.tensorboard=false",
                               "policy.micro_batch_size=64", "policy.optim.max_nonfinite_in_a_row=2",
                               f"trainer.output_dir={tmp_path}", "trainer.run_name=diverging"]
    with pytest.raises(SystemExit) as stopped:
        main(["train", *overrides])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "aligner-ext: error: 2 optimizer updates in a row had a non-finite loss" in error
    assert "Traceback" not in error
    run = tmp_path / "diverging"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r for r in records if "actor/num_updates" in r}
    assert trained[1]["actor/skipped_updates"] == 0 and trained[2]["actor/skipped_updates"] == 0
    assert trained[3]["actor/skipped_updates"] == 1 and trained[3]["actor/grad_norm"] is None  # NaN -> null
    assert 4 not in trained  # the second NaN update in a row stopped step 4 before it was logged
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_3"
    weights = load_file(str(checkpoints / "step_3" / "model.safetensors"))
    assert all(tensor.isfinite().all() for tensor in weights.values())

    monkeypatch.setattr(ClippedPGLoss, "__call__", honest)  # the cause fixed, the run resumes and finishes
    summary_code = main(["train", *overrides])
    assert summary_code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "actor/num_updates" in r] == [1, 2, 3, 4, 5, 6]


def test_finite_but_broken_weights_stop_the_run_and_the_last_good_checkpoint_stays_latest(tmp_path, monkeypatch,
                                                                                           capsys):
    """lr=1e30 from step 3 on: the update leaves finite weights that are garbage. The divergence guard
    (policy.optim.max_update_ratio) stops the run with one line and exit 2 before they are saved, and
    a resume with a sane learning rate finishes from the last good checkpoint."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # reward workers import e2e_rewards
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    run = tmp_path / "collapsing"
    overrides = SMALL_MODEL + ["trainer.save_every=1", "trainer.tensorboard=false", "policy.micro_batch_size=64",
                               "+reward.sources.arithmetic=e2e_rewards.digit_fraction",  # every step updates
                               f"trainer.output_dir={tmp_path}", "trainer.run_name=collapsing"]
    assert main(["train", *overrides, "trainer.total_steps=2"]) == 0
    good = load_file(str(run / "checkpoints" / "step_2" / "model.safetensors"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sane = [r["actor/update_ratio_max"] for r in records if "actor/num_updates" in r]
    assert 0 < max(sane) < 1e-2  # far below the default bound, 0.1

    with pytest.raises(SystemExit) as stopped:
        main(["train", *overrides, "trainer.total_steps=4", "policy.optim.lr=1e30"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "aligner-ext: error: step 3: an optimizer update changed the weights' norm by" in error
    assert "policy.optim.max_update_ratio=0.1" in error and "Traceback" not in error
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    assert not (checkpoints / "step_3").exists()
    kept = load_file(str(checkpoints / "step_2" / "model.safetensors"))
    assert all(torch.equal(kept[name], good[name]) for name in good)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    diverged = [r for r in records if r.get("actor/diverged_updates")]
    assert [r["step"] for r in diverged] == [3]  # logged, then stopped
    ratio = diverged[0]["actor/update_ratio_max"]
    assert ratio is None or ratio > 0.1  # None: inf (the norm's square overflowed float32), written as null

    assert main(["train", *overrides, "trainer.total_steps=4"]) == 0  # resumed at a sane lr: recovers from step 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["actor/update_ratio_max"] for r in records if r.get("step") == 4 and "actor/num_updates" in r) < 1e-2


def test_the_megatron_backend_stops_a_collapsing_run_the_same_way(tmp_path):
    """TP=2 on CPU (gloo): a good step 1 is saved; at lr=1e30 step 2 diverges on both ranks, the run
    exits 2 with the line, and step 1 stays latest."""
    pytest.importorskip("megatron.core")
    import subprocess
    import sys

    e2e = Path(__file__).parent
    overrides = SMALL_MODEL + ["model.tiny.num_kv_heads=2", "rollout.max_response_length=12", "trainer.tensorboard=false",
                               "+reward.sources.arithmetic=e2e_rewards.digit_fraction", "policy.backend=megatron",
                               "policy.tensor_model_parallel_size=2", "policy.dtype=float32", "trainer.save_every=1",
                               f"trainer.output_dir={tmp_path}", "trainer.run_name=collapsing"]

    def launch(*extra: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(e2e))
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--standalone", "-m", "aligner_ext", "train", *overrides, *extra],
                              env=env, capture_output=True, text=True, timeout=300)

    good = launch("trainer.total_steps=1", "policy.optim.lr=1e-3")
    assert good.returncode == 0, good.stderr[-4000:]
    collapsed = launch("trainer.total_steps=3", "policy.optim.lr=1e30")
    assert collapsed.returncode != 0
    assert "aligner-ext: error: step 2: an optimizer update changed the weights' norm by" in collapsed.stderr
    checkpoints = tmp_path / "collapsing" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_1"
    assert not (checkpoints / "step_2").exists()
    records = [json.loads(line) for line in (tmp_path / "collapsing" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("actor/diverged_updates")] == [2]
    sane = [r["actor/update_ratio_max"] for r in records if r["step"] == 1 and "actor/num_updates" in r]
    assert len(sane) == 1 and 0 < sane[0] < 1e-2  # step 1, at a sane lr
