"""Mixture-of-experts policies on the HF backend (models/moe.py): the expert load and router entropy
in the training metrics, over real tokens only, and the load-balancing loss as an option. Expected
values are computed here from the router's own weights in float64 (Switch Transformer's formula as
transformers writes it, pooled over the layers: E * sum_e f_e * P_e, f_e the top-k choices of expert
e per token, P_e its mean router probability). The models run
in float32: transformers' grouped expert product takes no float64."""

import copy
import math

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from aligner_ext.errors import ConfigError
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.family_configs import random_model
from aligner_ext.models.hf import HFPolicy
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from test_hf_policy import ragged_batch

EXPERTS, TOP_K = 4, 2
SIZES = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=32, moe_intermediate_size=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
             max_position_embeddings=32)


def moe_model(kind: str = "qwen3_moe"):
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(head_dim=8, norm_topk_prob=True, **SIZES)
    else:
        config = Qwen2MoeConfig(shared_expert_intermediate_size=12, **SIZES)
    torch.manual_seed(0)
    return random_model(config).float().eval()


def router_inputs(model, batch) -> list[torch.Tensor]:
    """Each MoE layer's input (post-attention-norm hidden states), flattened to [tokens, H], captured
    from a plain forward (with its graph: a layer's routing changes the next layer's input)."""
    captured = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda module, args: captured.append(args[0].flatten(0, -2)))
             for layer in model.model.layers]
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    for hook in hooks:
        hook.remove()
    return captured


def expected_statistics(model, batch) -> tuple[list[float], list[float], torch.Tensor]:
    """Per layer, over the real tokens: the largest top-k share times E, the mean router entropy; and
    the load-balancing loss as a function of the router weights (for its gradient)."""
    real = batch.attention_mask.flatten().bool()
    loads, entropies, choices, probabilities = [], [], [], []
    for layer, hidden in zip(model.model.layers, router_inputs(model, batch)):
        logits = hidden[real].double() @ layer.mlp.gate.weight.double().T  # [tokens, E]
        probs = torch.softmax(logits, dim=-1)
        entropies.append(float(-(probs * probs.log()).sum(-1).mean().detach()))
        top = probs.topk(TOP_K, dim=-1).indices  # [tokens, k]
        counts = [sum(int((top[t] == e).sum()) for t in range(len(top))) for e in range(EXPERTS)]
        loads.append(max(counts) / (TOP_K * len(top)) * EXPERTS)
        choices.append(top)
        probabilities.append(probs)
    # pooled over the layers' tokens: f[e], the top-k choices of e per token; P[e], the mean probability
    top, probs = torch.cat(choices), torch.cat(probabilities)
    f = torch.stack([(top == e).double().sum() / len(top) for e in range(EXPERTS)])
    return loads, entropies, EXPERTS * (f * probs.mean(0)).sum()


def train_once(model, batch, coefficient: float, packed: bool = False,
               micro_batch_size: int = 8) -> tuple[dict, list[torch.Tensor]]:
    cfg = PolicyConfig(device="cpu", dtype="float32", router_aux_loss_coef=coefficient,
                       micro_batch_size=micro_batch_size,
                       micro_batch_tokens=64 if packed else 0,  # packed: every row end to end in one
                       optim=OptimConfig(grad_clip=0))  # the gradients as computed, unclipped
    policy = HFPolicy(copy.deepcopy(model), cfg, total_steps=10)
    batch.old_logprobs, _ = policy.logprobs(batch, temperature=1.0)
    policy.model.train()
    metrics, _, _ = policy._update(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    return metrics, [layer.mlp.gate.weight.grad.clone() for layer in policy.model.model.layers]


# rows=1: a micro-batch per row, pooled into the mini-batch's statistics (not a mean of micro-batch maxima)
@pytest.mark.parametrize("kind, packed, rows", [("qwen3_moe", False, 8), ("qwen2_moe", False, 8),
                                                ("qwen3_moe", True, 8), ("qwen3_moe", False, 1)])
def test_expert_load_and_router_entropy_are_in_the_metrics_over_real_tokens(kind, packed, rows):
    model = moe_model(kind)
    batch = ragged_batch(SIZES["vocab_size"])
    batch.advantages = batch.response_mask.double()
    loads, entropies, _ = expected_statistics(model, batch)
    metrics, _ = train_once(model, batch, 0.0, packed, micro_batch_size=rows)
    for layer in range(2):
        assert metrics[f"moe/load_max/layer_{layer}"] == pytest.approx(loads[layer], rel=1e-5)
        assert metrics[f"moe/router_entropy/layer_{layer}"] == pytest.approx(entropies[layer], rel=1e-5)
        assert 1.0 <= loads[layer] <= EXPERTS / TOP_K and 0 < entropies[layer] <= math.log(EXPERTS)
    assert metrics["moe/load_max"] == pytest.approx(sum(loads) / 2, rel=1e-5)
    assert "loss/router_aux" not in metrics  # off by default


def test_the_load_balancing_loss_adds_its_coefficient_times_its_gradient():
    model = moe_model()
    batch = ragged_batch(SIZES["vocab_size"])
    batch.advantages = batch.response_mask.double()
    _, _, aux = expected_statistics(model, batch)
    aux_grads = torch.autograd.grad(aux, [layer.mlp.gate.weight for layer in model.model.layers])
    plain_metrics, plain = train_once(model, batch, 0.0)
    metrics, balanced = train_once(model, batch, 0.5)
    assert metrics["loss/router_aux"] == pytest.approx(float(aux), rel=1e-5)
    assert plain_metrics["loss/pg"] == pytest.approx(metrics["loss/pg"], rel=1e-6)
    for with_aux, without, expected in zip(balanced, plain, aux_grads):
        torch.testing.assert_close(with_aux - without, 0.5 * expected.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_a_load_balancing_loss_on_a_dense_model_is_refused(tiny_model, backend):
    """In one line, before the Megatron backend starts any process group (its loss on a mixture of
    experts: tests/megatron/test_megatron_routing.py)."""
    if backend == "megatron":
        policy_class = pytest.importorskip("aligner_ext.models.megatron.policy").MegatronPolicy
    else:
        policy_class = HFPolicy
    cfg = PolicyConfig(backend=backend, device="cpu", router_aux_loss_coef=0.01)
    with pytest.raises(ConfigError) as refused:
        policy_class(tiny_model, cfg, total_steps=1)
    assert "policy.router_aux_loss_coef=0.01: the model (llama) has no router" in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("backend, overrides", [("hf", []), ("megatron", []),
                                                ("megatron", ["policy.expert_model_parallel_size=2"])])
def test_auto_generates_a_mixture_of_experts_with_the_rollout_engine_where_it_runs(backend, overrides):
    """On a GPU, `auto` takes the rollout engine: on the HF backend's modules and on the Megatron
    backend's shards, under expert parallelism too (tests/unit/test_support.py)."""
    from aligner_ext.config import load_config
    from aligner_ext.trainer.build import generation_engine_name

    config = moe_model().config
    cfg = load_config("base", [f"policy.backend={backend}", *overrides])
    assert generation_engine_name(cfg, config, torch.device("cuda")) == "rollout"
