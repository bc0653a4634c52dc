"""One GRPO step of `aligner-ext train model.path=DIR` for a checkpoint of every dense family
(`family_configs`: tiny sizes, the built-in task's character tokenizer as vocabulary), end to end:
on the HF backend with the rollout engine (every family), and on the Megatron backend at TP=2 under
torchrun with the rollout engine on its shards (Gemma 3 and OLMo 2, the families with the most pieces
Llama lacks: sandwich / post norms, GeGLU, scaled embeddings, per-type RoPE bases and windows, q/k
norms over the whole projection split over the ranks); and a mixture of experts on each backend.

In float32 at temperature 1 the engine's log-probs are the trainer's own, so the step's recorded
`rollout/logprob_diff_max` (engine against trainer) is float32 rounding on every family: a decoder
that computed another model would show differences of order 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner_ext.config import load_config
from aligner_ext.models.family_configs import LAYOUTS, family_config, random_model
from aligner_ext.models.tiny import build_char_tokenizer
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

SIZES = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, max_position_embeddings=512, sliding_window=8)
STEP = ["rollout.max_response_length=12", "trainer.total_steps=1", "trainer.tensorboard=false",
        "generator.engine=rollout", "policy.dtype=float32"]


def family_checkpoint(directory, family: str):
    """A random-weight checkpoint of `family` over the character tokenizer, saved with it."""
    tokenizer = build_char_tokenizer()
    config = family_config(family, **SIZES, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    random_model(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def step_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_one_grpo_step_on_the_hf_backend_with_the_rollout_engine(tmp_path, family):
    model = family_checkpoint(tmp_path / "model", family)
    cfg = load_config("base", SMALL_MODEL + STEP + [f"model.path={model}", f"trainer.output_dir={tmp_path}",
                                                   "trainer.run_name=run"])
    train(cfg)
    records = step_records(tmp_path / "run")
    assert [record["step"] for record in records] == [0, 1]
    assert records[1]["batch/num_samples"] > 0 and "actor/grad_norm" in records[1]
    assert records[1]["rollout/logprob_diff_max"] < 1e-4


@pytest.mark.parametrize("family", ["gemma3_text", "olmo2"])
def test_one_grpo_step_on_the_megatron_backend_at_tp2(tmp_path, family):
    pytest.importorskip("megatron.core")
    model = family_checkpoint(tmp_path / "model", family)
    check_megatron_step_at_tp2(tmp_path, [*STEP, f"model.path={model}"])


def check_megatron_step_at_tp2(tmp_path, overrides: list[str]) -> None:
    """One step of `aligner-ext train` on the Megatron backend at TP=2 under torchrun: it finishes, trains,
    and the engine's log-probs are the trainer's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               "-m", "aligner_ext", "train", *SMALL_MODEL, *overrides, "policy.backend=megatron",
               "policy.tensor_model_parallel_size=2", f"trainer.output_dir={tmp_path}", "trainer.run_name=run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                                            os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    records = step_records(tmp_path / "run")
    assert [record["step"] for record in records] == [0, 1]
    assert records[1]["batch/num_samples"] > 0 and "actor/grad_norm" in records[1]
    assert records[1]["rollout/logprob_diff_max"] < 1e-4


def qwen3_moe_checkpoint(directory):
    """A random-weight Qwen3-MoE checkpoint (4 experts, top 2) over the character tokenizer."""
    from transformers import Qwen3MoeConfig

    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    random_model(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_mixture_of_experts_trains_on_the_hf_backend_and_logs_its_routers(tmp_path):
    """A Qwen3-MoE checkpoint: one step with the rollout engine on transformers' own expert tensors (its
    log-probs are the trainer's to float32 rounding), the expert load and router entropy per layer in
    the step's metrics, the load-balancing loss when its coefficient is set, and how often the trainer's
    routers chose other experts than the engine's."""
    overrides = [*SMALL_MODEL, *STEP, f"model.path={qwen3_moe_checkpoint(tmp_path / 'model')}",
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "policy.router_aux_loss_coef=0.01"]
    train(load_config("base", overrides))
    step = step_records(tmp_path / "run")[1]
    assert step["rollout/logprob_diff_max"] < 1e-4
    for key in ("moe/load_max/layer_0", "moe/load_max/layer_1", "moe/router_entropy/layer_1", "loss/router_aux",
                "moe/routing_mismatch/layer_1", "moe/routing_mismatch_tokens"):
        assert key in step, key
    assert 1.0 <= step["moe/load_max"] <= 2.0  # 4 experts, top 2
    assert 0 < step["moe/router_entropy"] <= 1.3863  # log 4
    assert 0 <= step["moe/routing_mismatch"] < 0.05  # float32 on both sides: a near tie may flip, rarely


def test_routing_replay_trains_a_mixture_of_experts_on_the_engines_experts(tmp_path):
    """One step with `policy.routing_replay`: the trainer's forwards (the old-log-prob pass included, two
    updates) take the engine's experts, so its log-probs are the engine's to float32 rounding, and the
    mismatch of its own routers is reported beside it."""
    overrides = [*SMALL_MODEL, *STEP, f"model.path={qwen3_moe_checkpoint(tmp_path / 'model')}",
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "policy.routing_replay=true",
                 "policy.num_iterations=2"]
    train(load_config("base", overrides))
    step = step_records(tmp_path / "run")[1]
    assert step["actor/num_updates"] == 2
    assert step["rollout/logprob_diff_max"] < 1e-4
    assert 0 <= step["moe/routing_mismatch"] < 0.05


# Each variant with a mixture of experts, its routing replayed where the variant trains on what the engine
# generated (the graded prompt trains its graded rows on another prompt: replay refused, the mismatch kept);
# agent episodes replay the routing of every turn over the observations between them
MOE_VARIANTS = {
    "dapo": ["+variant=dapo", "+reward.sources.arithmetic=e2e_rewards.character_parity", "policy.routing_replay=true"],
    "graded_prompt": ["+variant=graded_prompt"],
    "mtpo": ["+variant=mtpo", "mtpo.num_confidence_generations=2", "policy.routing_replay=true"],
    "cpo": ["+variant=cpo", "policy.routing_replay=true"],
    "agent_episodes": ["algorithm.experience_maker=agent_episodes", "agents.environment=e2e_environments.Retry",
                       "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256",
                       "+reward.sources.arithmetic=e2e_rewards.digit_fraction", "policy.routing_replay=true"],
}


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_a_mixture_of_experts_trains_with_every_variant(tmp_path, variant):
    overrides = [*SMALL_MODEL, *STEP, f"model.path={qwen3_moe_checkpoint(tmp_path / 'model')}",
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=run", *MOE_VARIANTS[variant]]
    train(load_config("base", overrides))
    step = step_records(tmp_path / "run")[1]
    assert step["actor/num_updates"] >= 1 and "moe/load_max" in step
    assert 0 <= step["moe/routing_mismatch"] < 0.05  # float32 on both sides: a near tie may flip, rarely


def test_a_mixture_of_experts_generated_ahead_at_staleness_zero_is_the_synchronous_run(tmp_path):
    """Generation ahead of training (trainer.asynchronous) on the HF backend's mixture of experts, the rollout
    engine sampling from the copy: at max_staleness=0 the synchronous run bit for bit, an importance-sampling
    correction reading the engine's log-probs included."""
    from test_async_runs import assert_the_same_run

    model = qwen3_moe_checkpoint(tmp_path / "model")
    steps = [o for o in STEP if not o.startswith("trainer.total_steps")] + [
        "trainer.total_steps=2", "policy.optim.lr=1e-3", "loss.importance_sampling_cap=2",
        "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]  # a dense reward: every step learns

    def run(name, *extra):
        train(load_config("base", [*SMALL_MODEL, *steps, f"model.path={model}", f"trainer.output_dir={tmp_path}",
                                   f"trainer.run_name={name}", *extra]))
        return step_records(tmp_path / name), tmp_path / name

    synchronous, sync_dir = run("sync")
    ahead, ahead_dir = run("ahead", "trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=0")
    assert_the_same_run(synchronous, sync_dir, ahead, ahead_dir, steps=2)
    assert "moe/routing_mismatch" in ahead[2]


def test_a_mixture_of_experts_trains_on_the_megatron_backend_at_tp2_with_sequence_parallelism(tmp_path):
    """A Qwen2-MoE checkpoint (shared expert, unnormalised top 2) on megatron-core's MoE layers at TP=2
    with sequence parallelism under torchrun, generating with the HF engine from the refitted HF copy
    (`auto`: the rollout engine runs no mixture of experts on the Megatron backend): the engine's log-probs
    are the trainer's."""
    pytest.importorskip("megatron.core")
    from transformers import Qwen2MoeConfig

    tokenizer = build_char_tokenizer()
    config = Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    random_model(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    step = [item for item in STEP if not item.startswith("generator.engine")]
    check_megatron_step_at_tp2(tmp_path, [*step, "generator.engine=auto", f"model.path={tmp_path / 'model'}",
                                          "policy.sequence_parallel=true"])
