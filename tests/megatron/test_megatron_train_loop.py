"""The whole training loop under `torchrun --nproc_per_node=2 -m aligner_ext train policy.backend=megatron
policy.tensor_model_parallel_size=2` on CPU (gloo), with the embedded tiny model.

Two launches: run `a` trains 4 steps straight (checkpoints at steps 2 and 4); run `b` is a copy of
`a` cut back to its step-2 checkpoint (as if killed after it) and resumed to step 4.
- Only rank 0 writes: one metrics line per step, one TensorBoard event file, 2 samples per step.
- The HF export loads in transformers and equals the trained TP shards gathered here with
  `convert.megatron_to_hf` from the two per-rank state files of the last checkpoint.
- 2 + 2 steps with resume equal 4 straight: the same weights (float32; measured bit-identical, the
  tolerance allows 1e-6 for reduction order) and the same per-step metrics apart from timings.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from aligner_ext.models.megatron import convert  # noqa: E402
from aligner_ext.models.megatron.parallel import free_port  # noqa: E402

pytestmark = pytest.mark.slow

E2E = Path(__file__).resolve().parent.parent / "e2e"  # e2e_rewards.py: a dense reward, so every step updates
OVERRIDES = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=64", "model.warmup.steps=30", "model.warmup.batch_size=16",
    "data.builtin_train_size=64", "data.builtin_val_size=8", "data.train_batch_size=4", "data.val_batch_size=8",
    "rollout.n=4", "rollout.max_response_length=12", "trainer.progress_bar=false", "trainer.tensorboard=true",
    "trainer.log_samples_every=1", "trainer.num_log_samples=2", "reward.num_workers=1",
    "+reward.sources.arithmetic=e2e_rewards.digit_fraction", "policy.backend=megatron",
    "policy.tensor_model_parallel_size=2", "policy.dtype=float32", "policy.optim.lr=1e-3",
    "trainer.total_steps=4", "trainer.save_every=2",
]


def launch(output_dir: Path, run_name: str, overrides: list[str] = OVERRIDES) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "aligner_ext", "train", *overrides, f"trainer.output_dir={output_dir}",
               f"trainer.run_name={run_name}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_loop")
    launch(root, "a")
    shutil.copytree(root / "a", root / "b")
    shutil.rmtree(root / "b" / "checkpoints" / "step_4")
    (root / "b" / "checkpoints" / "latest").write_text("step_2")
    launch(root, "b")
    return root


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_rank_runs_the_loop_and_rank_0_alone_writes(runs):
    run = runs / "a"
    history = records(run)
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4]
    assert all(r["actor/grad_norm"] > 0 for r in history[1:])  # every step updated the policy
    assert "val/accuracy" in history[0] and "val/accuracy" in history[4]
    assert len((run / "samples.jsonl").read_text().splitlines()) == 4 * 2
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert "tensor_model_parallel_size: 2" in (run / "config.yaml").read_text()
    step = run / "checkpoints" / "step_4"
    assert sorted(p.name for p in step.glob("trainer_state*.pt")) == ["trainer_state.pt", "trainer_state.rank1.pt"]


def test_hf_export_equals_the_trained_shards_gathered_over_tp(runs):
    run = runs / "a"
    config = AutoConfig.from_pretrained(run / "hf_model")
    step = run / "checkpoints" / "step_4"
    shards = {(0, r): torch.load(step / name, weights_only=False)["policy"]["weights"]
              for r, name in enumerate(["trainer_state.pt", "trainer_state.rank1.pt"])}
    assert not torch.equal(shards[(0, 0)]["decoder.layers.0.mlp.linear_fc2.weight"],
                           shards[(0, 1)]["decoder.layers.0.mlp.linear_fc2.weight"])  # real TP halves
    gathered = convert.megatron_to_hf(shards, config, tp=2, pp=1)
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    base = load_file(str(run / "base_model" / "model.safetensors"))
    for name, tensor in gathered.items():
        assert torch.equal(exported[name], tensor), name
    moved = max((gathered[k] - base[k]).abs().max().item() for k in gathered if k in base)
    assert moved > 1e-4  # the export is the trained policy, not the starting weights


def test_resume_2_plus_2_steps_equals_4_straight(runs):
    weights_a = load_file(str(runs / "a" / "checkpoints" / "step_4" / "model.safetensors"))
    weights_b = load_file(str(runs / "b" / "checkpoints" / "step_4" / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=0, atol=1e-6)

    def without_timings(run):
        return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records(run)]

    straight, resumed = without_timings(runs / "a"), without_timings(runs / "b")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
