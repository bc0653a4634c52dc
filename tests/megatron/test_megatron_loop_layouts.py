"""The whole training loop under `torchrun --nproc_per_node=2 -m aligner_ext train policy.backend=megatron`
at PP=2 and at DP=2 (TP=1), on CPU (gloo), with generation and rewards split across the two ranks.

The overrides are test_megatron_train_loop.py's (tiny 2-layer model, dense digit reward) with TP=1,
2 steps and micro-batches of 4 rows (so PP=2 runs 4 micro-batches through the 1F1B schedule and
each DP rank 2). Each layout is one launch (~20 s). Asserted:
- the run finishes: the ranks' batches stayed identical after every split generation and scoring
  (MegatronPolicy._check_replicated would raise otherwise);
- rank 0 alone wrote: one metrics line per step, one TensorBoard event file, 2 samples per step;
- it trained: every metric finite, a gradient at every step, exported weights moved from the start;
- with the KL term (DP=2; TP=2 with the sharded reference): the KL to the reference is ~0 at step
  1 (the policy starts as the reference) and positive after the first update.
- PP=2 with the rollout engine on the stages gathered in memory (`decoder.PipelineGather`): the
  sampling log-probs of step 2 (after an update) equal the trainer's (the other stage's copy was
  refreshed after the update).
- TP=2 with the rollout engine on the GPTModel's shards (`generator.engine=rollout`, the HF copy
  dropped): checkpoints hold the distributed checkpoint and no `model.safetensors`, a resumed run
  continues from them, and the export gathers the shards.
The numerics of each layout are pinned against HF by test_megatron_tp_pp.py, the sharded
generation by test_megatron_rollout.py.
"""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from test_megatron_train_loop import OVERRIDES, launch, records  # noqa: E402

pytestmark = pytest.mark.slow

REPLACED = ("policy.tensor_model_parallel_size", "trainer.total_steps", "trainer.save_every")
COMMON = [o for o in OVERRIDES if o.split("=")[0] not in REPLACED] + [
    "policy.tensor_model_parallel_size=1", "trainer.total_steps=2", "trainer.save_every=0", "policy.micro_batch_size=4",
]
# DP=2 also runs a KL term: the reference log-probs are split across the ranks (FrozenReference).
LAYOUTS = {"pp2": ["policy.pipeline_model_parallel_size=2", "generator.engine=rollout"], "dp2": ["loss.kl_coef=0.01"],
           "tp2_rollout": ["policy.tensor_model_parallel_size=2", "generator.engine=rollout", "loss.kl_coef=0.01",
                           "trainer.save_every=1"]}
KL_LAYOUTS = ("dp2", "tp2_rollout")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    launch(root, request.param, COMMON + LAYOUTS[request.param])
    return request.param, root / request.param


def test_rank_0_alone_logs_finite_metrics_of_every_step(run):
    _, run_dir = run
    history = records(run_dir)
    assert [r["step"] for r in history] == [0, 1, 2]
    for record in history:
        assert all(math.isfinite(v) for v in record.values()), record
    assert all(r["actor/grad_norm"] > 0 for r in history[1:])
    assert history[1]["batch/num_samples"] == 16.0  # 4 prompts x 4 samples, gathered from both ranks
    assert "val/accuracy" in history[0] and "val/accuracy" in history[2]
    assert len(list((run_dir / "tensorboard").iterdir())) == 1
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 2 * 2
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_the_kl_term_sees_the_policy_leave_the_reference(run):
    layout, run_dir = run
    if layout not in KL_LAYOUTS:
        pytest.skip(f"the KL term runs at {', '.join(KL_LAYOUTS)}")
    history = records(run_dir)
    assert abs(history[1]["loss/kl"]) < 1e-6  # Megatron and HF float32 log-probs of the same weights
    assert history[2]["loss/kl"] > 1e-6


def test_the_exported_policy_trained_away_from_the_start(run):
    layout, run_dir = run
    assert f"pipeline_model_parallel_size: {2 if layout == 'pp2' else 1}" in (run_dir / "config.yaml").read_text()
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model").state_dict()
    base = load_file(str(run_dir / "base_model" / "model.safetensors"))
    assert base.keys() <= exported.keys()
    assert max((exported[k] - base[k]).abs().max().item() for k in base) > 1e-4


def test_generating_on_the_shards_checkpoints_them_alone_and_resumes(run, tmp_path):
    layout, run_dir = run
    if layout != "tp2_rollout":
        pytest.skip("the rollout engine on the shards runs at tp2_rollout")
    step_2 = run_dir / "checkpoints" / "step_2"
    assert sorted(p.name for p in step_2.iterdir()) == ["manifest.json", "megatron", "tokenizer", "trainer_state.pt"]
    launch(run_dir.parent, layout, COMMON + LAYOUTS[layout] + ["trainer.total_steps=3", "trainer.resume=true"])
    history = records(run_dir)
    assert [r["step"] for r in history][-2:] == [2, 3]  # one more step after the resumed step 2
    assert all(math.isfinite(v) for v in history[-1].values())


def test_generation_after_an_update_runs_the_updated_weights(run):
    """Float32 on the CPU: the engine's log-probs of its samples equal the trainer's to ~1e-6 when it
    decodes the weights the trainer holds; stale weights of one stage would differ by the update."""
    layout, run_dir = run
    history = records(run_dir)
    assert history[2]["rollout/logprob_diff_max"] < 1e-4, layout
