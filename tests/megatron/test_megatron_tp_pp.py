"""TP=2, PP=2, DP=2 and TP=2 with sequence parallelism on CPU under torchrun (gloo) against the HF
backend on the same weights.

One torchrun launch (tests/megatron/worker.py, 2 processes) runs every case and layout:
- log-probs, entropy and the gradient of the summed valid log-probs at TP=2, PP=2 and TP=1 (DP=2)
  for every case (every dense family, megatron_cases.py; the mixtures of experts at TP=2 with
  sequence parallelism, padded and packed, instead of plain TP=2), and at TP=2 + SP and packed for a subset
  (`SP_PACKED_CASES`), against a float64 HF reference computed here. Tolerance: the Megatron side
  runs in float32, so 1e-5 absolute on log-probs and entropy (values of order 1-5; float32 reduction-order differences
  measured ~5e-7), and 1e-5 relative to the largest gradient entry of each tensor.
- one `MegatronPolicy.train` call (two optimizer updates, clipped PG loss, gradient clipping
  active) at TP=2, PP=2, DP=2 and TP=2 + SP with micro-batches of 1 row (`TRAIN_CASES`: Llama,
  Qwen3, OLMo 3's TP-sharded q/k norms and post-norms, Gemma 3's sandwich norms, Qwen2-MoE's experts
  and their expert loads and router entropies in the metrics), against
  `HFPolicy` (float32) with the whole mini-batch in one micro-batch: the same loss, gradient norm and updated weights, so the
  update depends neither on the layout, the DP size nor the micro-batch split. Tolerance: 1e-5
  relative on loss and norm, 2e-5 absolute on weights (which move by up to 2e-2; measured <= 4e-6).
- the in-place refit of an HF model from the GPTModel at each of those layouts (`weights.py`): every
  HF parameter, zeroed first, equals the weights the GPTModel was loaded from, bit for bit; and
  megatron-core's gradient-norm selection counts every weight once (over the weights: HF's norm).
- one on-policy update on a batch without old log-probs (the loop's shortcut) at TP=2 + SP packed,
  PP=2 packed and DP=2: the train call fills the old log-probs and entropy from its own forward
  (equal to the HF backend's separate pass) and updates as the HF backend does after that pass.
- expert parallelism (EP=2: the mixtures of experts' 4 experts split over the 2 DP ranks, 2 each):
  log-probs, gradients, refit, counted norm and the train call as above at EP=2 (`tp1_pp1_ep2`, in the
  same launch), and at TP=2 + SP x EP=2 in a second launch of 4 processes (`FOUR_RANK_LAYOUT`).
- the guard of the replicated loop: a batch that differs on one rank raises with the reason (on both
  ranks, so nothing hangs). (Checkpoints resume at another layout: test_dist_checkpoint.py; the
  routers of a mixture of experts against the engine's routing: test_megatron_routing.py.)
"""

import dataclasses

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.batch import ExperienceBatch, SampleInfo  # noqa: E402
from aligner_ext.losses.clipped_pg import ClippedPGLoss  # noqa: E402
from aligner_ext.models.hf import HFPolicy  # noqa: E402
from aligner_ext.models.settings import OptimConfig, PolicyConfig  # noqa: E402
from aligner_ext.models.megatron.convert import stacked_experts  # noqa: E402
from megatron_cases import MOE_CASES, batch_tensors, build_model, hf_configs, torchrun  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("worker.py")
# _sp: sequence parallel; _packed: sequences packed end to end under a token budget (worker.py); tp1_pp1: DP=2
EVERY_CASE_LAYOUTS = ["tp2_pp1", "tp1_pp2", "tp1_pp1"]
SP_PACKED_LAYOUTS = ["tp2_pp1_sp", "tp2_pp1_packed", "tp1_pp2_packed", "tp2_pp1_sp_packed"]
# the first cases, and the families whose pieces meet sequence parallelism or packing: OLMo 3 (post-norms
# on sequence shards, projection q/k norms, windows per layer type), Gemma 3 (sandwich norms, windows and
# RoPE bases per layer type), Phi-3 (partial rotary and a window on every layer, per packed sequence)
SP_PACKED_CASES = ["llama", "qwen2", "qwen3", "olmo3", "gemma3_text", "phi3"]
# a mixture of experts under TP trains with sequence parallelism only (megatron-core's MoE layer refuses it without)
# _ep2: the experts split over the two DP ranks (expert parallelism)
MOE_LAYOUTS = ["tp1_pp1", "tp1_pp2", "tp2_pp1_sp", "tp2_pp1_sp_packed", "tp1_pp1_ep2"]
FOUR_RANK_LAYOUT = "tp2_pp1_ep2_sp"  # TP=2 x EP=2 over DP=2, sequence parallel: worker.four_ranks
LOGPROB_CASES = [(name, layout) for name in sorted(hf_configs()) if name not in MOE_CASES
                 for layout in EVERY_CASE_LAYOUTS + SP_PACKED_LAYOUTS
                 if layout in EVERY_CASE_LAYOUTS or name in SP_PACKED_CASES]
LOGPROB_CASES += [(name, layout) for name in MOE_CASES for layout in MOE_LAYOUTS]
TRAIN_CASES = ["llama", "qwen3", "olmo3", "gemma3_text", "qwen2_moe"]
# tp1_pp1 is DP=2 on two processes; _packed trains with micro_batch_tokens and activation recomputation
TRAIN_LAYOUTS = ["tp2_pp1", "tp1_pp2", "tp1_pp1", "tp2_pp1_sp", "tp2_pp1_sp_packed", "tp1_pp2_packed",
                 "tp1_pp1_packed"]
TRAIN_RUNS = [(name, layout) for name in TRAIN_CASES for layout in TRAIN_LAYOUTS
              if not (name in MOE_CASES and layout == "tp2_pp1")]
TRAIN_RUNS += [(name, "tp1_pp1_ep2") for name in TRAIN_CASES if name in MOE_CASES]
POLICY_CFG = PolicyConfig(backend="megatron", dtype="float32", device="cpu", micro_batch_size=1, mini_batch_size=2,
                          logprob_chunk_size=3, optim=OptimConfig(lr=1e-2, eps=1e-4, grad_clip=1.0))
OLD_OFFSET = torch.tensor([[0.3, -0.3, 0.0, 0.1], [-0.4, 0.0, 0.0, 0.0], [0.05, 0.2, -0.25, 0.0]])


def train_setup(vocab_size: int) -> dict:
    """A batch with advantages [1, -0.5, 0.25] per row, and old log-probs offset so both clips fire."""
    tensors = batch_tensors(vocab_size)
    batch = ExperienceBatch(samples=[SampleInfo(row=None) for _ in range(3)], response_mask=tensors["response_valid"],
                            group_ids=torch.tensor([0, 0, 1]), **tensors)
    batch.advantages = torch.tensor([[1.0], [-0.5], [0.25]]).expand(3, 4).clone()
    return {"batch": batch, "old_offset": OLD_OFFSET, "policy_cfg": POLICY_CFG}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_cases")
    for name, config in hf_configs().items():
        build_model(config).save_pretrained(root / name)
        torch.save(batch_tensors(config.vocab_size), root / name / "batch.pt")
        torch.save(train_setup(config.vocab_size), root / name / "train_setup.pt")
    (root / "logprob_cases.txt").write_text("\n".join(f"{name} {layout}" for name, layout in LOGPROB_CASES))
    (root / "train_cases.txt").write_text(" ".join(TRAIN_CASES))
    torchrun([str(WORKER), str(root)], timeout=600)  # a hang guard: its cases take about a minute on 2 cores
    return root


@pytest.fixture(scope="module")
def four_rank_cases(cases):
    """The same cases, with the mixtures of experts run at TP=2 + SP x EP=2 by 4 processes."""
    torchrun([str(WORKER), str(cases)], processes=4, timeout=600)
    return cases


def hf_float64(case: Path):
    from transformers import AutoModelForCausalLM

    # transformers' grouped expert product takes no float64: its per-expert loop does
    return AutoModelForCausalLM.from_pretrained(case, dtype=torch.float64, experts_implementation="eager")


def hf_reference(case: Path):
    """Float64 HF log-probs [B, R], entropy [B, R], and gradients of sum(valid log-probs)."""

    model = hf_float64(case)
    batch = torch.load(case / "batch.pt")
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["response_valid"]], dim=1).long()
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    width, response_width = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    logp = torch.log_softmax(logits[:, width - 1 : width - 1 + response_width], dim=-1)
    logprobs = logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    valid = batch["response_valid"]
    (logprobs * valid).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logprobs.detach(), entropy.detach(), grads, valid


@pytest.mark.parametrize("name, layout", LOGPROB_CASES)
def test_logprobs_entropy_and_gradient_match_hf(cases, name, layout):
    logprobs, entropy, grads, valid = hf_reference(cases / name)
    result = torch.load(cases / name / f"{layout}.pt")
    assert torch.allclose(result["logprobs"].double() * valid, logprobs * valid, atol=1e-5, rtol=0)
    assert torch.allclose(result["entropy"].double() * valid, entropy * valid, atol=1e-5, rtol=0)
    if hf_configs()[name].tie_word_embeddings:
        grads.pop("lm_head.weight", None)  # the same tensor as the embedding
    assert set(result["grads"]) == set(grads)
    for key, expected in grads.items():
        scale = expected.abs().max().clamp(min=1e-12)
        assert ((result["grads"][key].double() - expected).abs().max() / scale) < 1e-5, key


@pytest.mark.parametrize("name, layout", LOGPROB_CASES)
def test_refit_writes_every_hf_parameter_bit_for_bit(cases, name, layout):
    """The GPTModel was loaded from these HF weights; refitting it into a zeroed HF model gives them back."""
    from safetensors.torch import load_file

    expected = stacked_experts(load_file(cases / name / "model.safetensors"))  # save_pretrained: no lm_head when tied
    refit = torch.load(cases / name / f"{layout}.pt")["refit"]
    for key, weight in expected.items():
        assert torch.equal(refit[key], weight), key
    if hf_configs()[name].tie_word_embeddings:
        assert torch.equal(refit["lm_head.weight"], expected["model.embed_tokens.weight"])
    else:
        assert set(refit) == set(expected)


@pytest.mark.parametrize("name, layout", LOGPROB_CASES)
def test_the_gradient_norm_counts_every_weight_once(cases, name, layout):
    """megatron-core's gradient norm (the clipping's) takes a parameter from TP rank 0 alone unless it
    is marked TP-sharded: over the weights it gives the HF model's norm, so no shard is left out and
    no replica counted twice (OLMo's q/k norms over the projection are sharded; replicated norm
    weights, near 1, weigh in this norm more than in the gradient's)."""
    from safetensors.torch import load_file

    weights = load_file(cases / name / "model.safetensors")
    expected = float(torch.sqrt(sum(w.double().pow(2).sum() for w in weights.values())))
    assert torch.load(cases / name / f"{layout}.pt")["counted_weight_norm"] == pytest.approx(expected, rel=1e-6)


def hf_policy_step(case: Path) -> dict:
    """The HF backend's old log-probs, train metrics, new log-probs and weights on the same setup."""
    from transformers import AutoModelForCausalLM

    setup = torch.load(case / "train_setup.pt", weights_only=False)
    cfg = dataclasses.replace(setup["policy_cfg"], backend="hf", micro_batch_size=64)
    policy = HFPolicy(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32), cfg, total_steps=4)
    batch = setup["batch"]
    logprobs, _ = policy.logprobs(batch, 1.0)
    batch.old_logprobs = logprobs + setup["old_offset"]
    metrics = policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)
    new_logprobs, _ = policy.logprobs(batch, 1.0)
    return {"logprobs": logprobs, "metrics": metrics, "new_logprobs": new_logprobs, "state": policy.model.state_dict()}


@pytest.mark.parametrize("name, layout", TRAIN_RUNS)
def test_one_train_call_matches_the_hf_backend(cases, name, layout):
    expected = hf_policy_step(cases / name)
    result = torch.load(cases / name / f"train_{layout}.pt", weights_only=False)
    assert torch.allclose(result["logprobs"], expected["logprobs"], atol=1e-5, rtol=0)
    for key in ("loss/total", "loss/pg", "actor/grad_norm", "actor/grad_norm_max", "actor/ratio_mean",
                "actor/clip_frac_high", "actor/clip_frac_low", "actor/num_updates", "actor/lr"):
        assert result["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5, abs=1e-7), key
    assert expected["metrics"]["actor/grad_norm"] > POLICY_CFG.optim.grad_clip  # clipping was active
    assert expected["metrics"]["actor/clip_frac_high"] > 0  # and so was the PPO clip
    for key, weight in expected["state"].items():
        assert torch.allclose(result["state"][key], weight, atol=2e-5, rtol=0), key
    assert torch.allclose(result["new_logprobs"], expected["new_logprobs"], atol=1e-5, rtol=0)
    routers = sorted(key for key in expected["metrics"] if key.startswith("moe/"))
    assert (name in MOE_CASES) == bool(routers)
    for key in routers:  # the expert loads and router entropies, over the same real tokens
        assert result["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5), key


@pytest.mark.parametrize("name", MOE_CASES)
def test_tensor_and_expert_parallel_on_four_ranks_match_hf(four_rank_cases, name):
    """TP=2 + SP x EP=2 (DP=2): log-probs, entropy, gradients, refit and the counted norm as at the
    other layouts; for Qwen2-MoE one train call equal to the HF backend's."""
    test_logprobs_entropy_and_gradient_match_hf(four_rank_cases, name, FOUR_RANK_LAYOUT)
    test_refit_writes_every_hf_parameter_bit_for_bit(four_rank_cases, name, FOUR_RANK_LAYOUT)
    test_the_gradient_norm_counts_every_weight_once(four_rank_cases, name, FOUR_RANK_LAYOUT)
    if name in TRAIN_CASES:
        test_one_train_call_matches_the_hf_backend(four_rank_cases, name, FOUR_RANK_LAYOUT)


@pytest.mark.parametrize("layout", ["tp2_pp1_sp_packed", "tp1_pp2_packed", "tp1_pp1"])
def test_one_on_policy_update_fills_the_old_logprobs_from_its_own_forward(cases, layout):
    """A batch without old log-probs, one update: the train call stores the log-probs and entropy of
    the weights before its update, and updates as the HF backend does after a separate pass."""
    from transformers import AutoModelForCausalLM

    case = cases / "llama"
    setup = torch.load(case / "train_setup.pt", weights_only=False)
    cfg = dataclasses.replace(setup["policy_cfg"], backend="hf", micro_batch_size=64, mini_batch_size=0)
    policy = HFPolicy(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32), cfg, total_steps=4)
    batch = setup["batch"]
    batch.old_logprobs, batch.entropy = policy.logprobs(batch, 1.0)
    expected = policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)
    result = torch.load(case / f"on_policy_{layout}.pt", weights_only=False)
    assert torch.allclose(result["old_logprobs"], batch.old_logprobs, atol=1e-5, rtol=0)
    assert torch.allclose(result["entropy"], batch.entropy, atol=1e-5, rtol=0)
    assert (result["old_logprobs"][~batch.response_valid] == 0).all()
    assert result["metrics"]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for key in ("loss/total", "loss/pg", "actor/grad_norm", "actor/num_updates"):
        assert result["metrics"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    for key, weight in policy.model.state_dict().items():
        assert torch.allclose(result["state"][key], weight, atol=2e-5, rtol=0), key
    moved = max(float((policy.model.state_dict()[k] - v).abs().max()) for k, v in
                AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32).state_dict().items())
    assert moved > 1e-3  # the update moved the weights


def test_a_batch_differing_between_ranks_is_refused(cases):
    errors = torch.load(cases / "llama" / "guards.pt")
    assert "rank 1 holds a different batch than rank 0" in errors["batch"]
