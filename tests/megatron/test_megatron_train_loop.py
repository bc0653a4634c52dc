"""The whole training loop under `torchrun --nproc_per_node=2 -m aligner_ext train policy.backend=megatron
policy.tensor_model_parallel_size=2` on CPU (gloo), with the embedded tiny model.

Three launches: run `a` trains 4 steps straight (checkpoints at steps 2 and 4); run `b` is a copy of
`a` cut back to its step-2 checkpoint (as if killed after it) and resumed to step 4; run `c` is the
same copy resumed by *one* process at TP=1 (another world size and layout) with nothing left to
train (total_steps=2), so it only loads, re-saves step 2 and exports.
- Only rank 0 writes: one metrics line per step, one TensorBoard event file, 2 samples per step,
  one trainer state file; the policy's distributed checkpoint is in `checkpoints/step_N/megatron/`.
- The HF export loads in transformers and equals the trained weights read back here from that
  distributed checkpoint (torch.distributed.checkpoint, no process group), mapped to HF names by hand.
- 2 + 2 steps with resume equal 4 straight: the same weights (float32; measured bit-identical, the
  tolerance allows 1e-6 for reduction order) and the same per-step metrics apart from timings.
- A checkpoint of 2 processes at TP=2 loads exactly in 1 process at TP=1: run `c`'s re-saved step 2
  holds the same global tensors, weights and Adam state, as `a`'s, and its export equals `a`'s step-2
  weights. (Training on after such a resume samples other rollouts, since generation is split over
  the processes; tests/megatron/test_dist_checkpoint.py checks the next update at another layout.)
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from aligner_ext.models.megatron import convert  # noqa: E402
from megatron_cases import torchrun  # noqa: E402

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
    "trainer.cpu_threads=1",  # runs that are compared sum floats alike whatever the load (tests/e2e/small_run.py)
]


def launch(output_dir: Path, run_name: str, overrides: list[str] = OVERRIDES, processes: int = 2) -> None:
    torchrun(["-m", "aligner_ext", "train", *overrides, f"trainer.output_dir={output_dir}",
              f"trainer.run_name={run_name}"], processes=processes, pythonpath=(str(E2E),))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_loop")
    launch(root, "a")
    for resumed in ("b", "c"):
        shutil.copytree(root / "a", root / resumed)
        shutil.rmtree(root / resumed / "checkpoints" / "step_4")
        (root / resumed / "checkpoints" / "latest").write_text("step_2")
    launch(root, "b")
    launch(root, "c", [*OVERRIDES, "policy.tensor_model_parallel_size=1", "trainer.total_steps=2"], processes=1)
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
    assert sorted(p.name for p in step.glob("trainer_state*.pt")) == ["trainer_state.pt"]
    assert (step / "megatron" / "metadata.json").exists()


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of a megatron-core distributed checkpoint (model and optimizer state), in its global
    (TP/PP-free) layout."""
    reader = dcp.FileSystemReader(directory)
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def global_to_hf(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """HF names of megatron-core's global tensors: layers stacked on dim 0, norms under the names of the
    layers they precede, fused QKV per KV group, SwiGLU fc1 as [gate; up], the vocabulary padded."""
    layers = "decoder.layers."
    hf = {"model.embed_tokens.weight": tensors["embedding.word_embeddings.weight"][: config.vocab_size],
          "model.norm.weight": tensors["decoder.final_layernorm.weight"]}
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        hf[prefix + "input_layernorm.weight"] = tensors[layers + "self_attention.linear_qkv.layer_norm_weight"][index]
        hf[prefix + "post_attention_layernorm.weight"] = tensors[layers + "mlp.linear_fc1.layer_norm_weight"][index]
        hf[prefix + "self_attn.o_proj.weight"] = tensors[layers + "self_attention.linear_proj.weight"][index]
        hf[prefix + "mlp.down_proj.weight"] = tensors[layers + "mlp.linear_fc2.weight"][index]
        gate, up = tensors[layers + "mlp.linear_fc1.weight"][index].chunk(2)
        hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"] = gate, up
        for kind in ("weight", "bias"):
            if layers + f"self_attention.linear_qkv.{kind}" in tensors:
                fused = tensors[layers + f"self_attention.linear_qkv.{kind}"][index]
                for name, part in zip("qkv", convert.unfuse_qkv(fused, config)):
                    hf[prefix + f"self_attn.{name}_proj.{kind}"] = part
    return hf


def test_hf_export_equals_the_trained_weights_of_the_distributed_checkpoint(runs):
    run = runs / "a"
    config = AutoConfig.from_pretrained(run / "hf_model")
    trained = global_to_hf(checkpoint_tensors(run / "checkpoints" / "step_4" / "megatron"), config)
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    base = load_file(str(run / "base_model" / "model.safetensors"))
    assert trained.keys() == base.keys()  # every HF tensor (tied: no lm_head) came from the checkpoint
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
    moved = max((trained[k] - base[k]).abs().max().item() for k in trained)
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


def test_a_checkpoint_of_2_processes_at_tp_2_loads_exactly_in_1_process_at_tp_1(runs):
    assert "tensor_model_parallel_size: 1" in (runs / "c" / "config.yaml").read_text()
    saved = checkpoint_tensors(runs / "a" / "checkpoints" / "step_2" / "megatron")
    resaved = checkpoint_tensors(runs / "c" / "checkpoints" / "step_2" / "megatron")
    assert saved.keys() == resaved.keys()
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in saved)
    for key, tensor in saved.items():
        assert torch.equal(resaved[key], tensor), key
    step_2 = load_file(str(runs / "a" / "checkpoints" / "step_2" / "model.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(runs / "c" / "hf_model").state_dict()
    for name, tensor in step_2.items():
        assert torch.equal(exported[name], tensor), name
