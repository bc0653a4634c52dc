"""The Megatron backend's grouped expert products (models/megatron/experts.py) against megatron-core's own
`SequentialMLP` forward on the same module and weights, one expert at a time, in float32 on the CPU:
outputs and the gradients of the tokens, the routing weights and every expert's weights, with an expert
that receives no token. The whole model's log-probs and gradients against transformers' in float64 run
through it in tests/megatron/test_megatron_routing.py and tests/unit/models/test_moe.py."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402

from aligner_ext.models.family_configs import random_model  # noqa: E402
from aligner_ext.models.megatron.experts import GroupedExperts  # noqa: E402
from aligner_ext.models.megatron.policy import MegatronPolicy  # noqa: E402
from aligner_ext.models.settings import PolicyConfig  # noqa: E402

EXPERTS, HIDDEN, FFN = 4, 16, 8
TOKENS_PER_EXPERT = [3, 0, 5, 2]  # expert 1 receives none


@pytest.fixture(scope="module")
def experts() -> GroupedExperts:
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=FFN,
                            num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=32)
    policy = MegatronPolicy(random_model(config), PolicyConfig(backend="megatron", device="cpu"), total_steps=1)
    return policy.core.decoder.layers[0].mlp.experts


def outputs_and_gradients(forward, experts: GroupedExperts) -> list[torch.Tensor]:
    """`forward`'s output on fixed tokens and routing weights, and the gradients of a fixed projection of it."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(sum(TOKENS_PER_EXPERT), HIDDEN, generator=generator).requires_grad_()
    probs = torch.rand(sum(TOKENS_PER_EXPERT), generator=generator).requires_grad_()
    projection = torch.randn(sum(TOKENS_PER_EXPERT), HIDDEN, generator=generator)
    weights = [p for expert in experts.local_experts for p in (expert.linear_fc1.weight, expert.linear_fc2.weight)]
    output, bias = forward(experts, tokens, torch.tensor(TOKENS_PER_EXPERT), probs)
    assert bias is None
    # autograd.grad, not backward: megatron-core's DDP hooks move a parameter's .grad into its own buffer
    return [output.detach(), *torch.autograd.grad((output * projection).sum(), [tokens, probs, *weights])]


def test_the_grouped_products_compute_what_megatron_cores_experts_compute(experts):
    assert type(experts) is GroupedExperts and experts.num_local_experts == EXPERTS
    assert experts.grouped_form_runs(torch.zeros(1, HIDDEN))
    grouped = outputs_and_gradients(GroupedExperts.forward, experts)
    sequential = outputs_and_gradients(SequentialMLP.forward, experts)
    assert all(gradient.abs().sum() == 0 for gradient in grouped[5:7])  # expert 1's fc1 and fc2: it saw no token
    for ours, theirs in zip(grouped, sequential):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_hook_on_an_experts_linear_keeps_megatron_cores_forward(experts):
    """An adapter's forward hook on an expert's linear would be skipped by the stacked weights: where one is
    set, each expert runs its own modules, and the hook sees its tokens."""
    seen = []
    handle = experts.local_experts[2].linear_fc1.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        assert not experts.grouped_form_runs(torch.zeros(1, HIDDEN))
        outputs_and_gradients(GroupedExperts.forward, experts)
    finally:
        handle.remove()
    assert [tuple(tokens.shape) for tokens in seen] == [(TOKENS_PER_EXPERT[2], HIDDEN)]
    assert not experts.grouped_form_runs(torch.zeros(1, HIDDEN, dtype=torch.float64))  # _grouped_mm takes no float64


def reference_outputs_and_gradients(experts: GroupedExperts, tokens: torch.Tensor, tokens_per_expert: list[int],
                                    probs: torch.Tensor, projection: torch.Tensor) -> list[torch.Tensor]:
    """What the experts compute, written from the formula in float64 (each expert's tokens through
    fc2(silu(gate) * up * routing weight), [gate; up] = fc1(tokens)), and the same gradients."""
    tokens, probs = tokens.double().detach().requires_grad_(), probs.double().detach().requires_grad_()
    weights = [p.detach().double().requires_grad_() for expert in experts.local_experts
               for p in (expert.linear_fc1.weight, expert.linear_fc2.weight)]
    pieces, start = [], 0
    for count, fc1, fc2 in zip(tokens_per_expert, weights[0::2], weights[1::2]):
        gate, up = (tokens[start : start + count] @ fc1.T).chunk(2, dim=-1)
        pieces.append((torch.nn.functional.silu(gate) * up * probs[start : start + count, None]) @ fc2.T)
        start += count
    output = torch.cat(pieces)
    return [output.detach(), *torch.autograd.grad((output * projection.double()).sum(), [tokens, probs, *weights])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 grouped products on a GPU")
def test_in_bfloat16_on_a_gpu_the_grouped_products_err_no_more_than_megatron_cores_experts():
    """At a Qwen3-30B-A3B layer's expert shapes (hidden 2048, experts of 768) in bfloat16, the grouped
    products' outputs and gradients are as close to a float64 reference as `SequentialMLP`'s are, with
    routes as uneven as a router makes them (one expert none, one most)."""
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=2048, num_hidden_layers=1, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    policy = MegatronPolicy(random_model(config), PolicyConfig(backend="megatron", device="cuda", dtype="bfloat16"),
                            total_steps=1)
    experts = policy.core.decoder.layers[0].mlp.experts
    assert type(experts) is GroupedExperts and experts.grouped_form_runs(torch.zeros(1, 2048, dtype=torch.bfloat16,
                                                                                      device="cuda"))
    tokens_per_expert = [0, 1, 7, 1200, 300, 64, 33, 443]
    generator = torch.Generator(device="cuda").manual_seed(0)
    count = sum(tokens_per_expert)
    tokens = torch.randn(count, 2048, generator=generator, device="cuda").bfloat16()
    probs = torch.rand(count, generator=generator, device="cuda")
    projection = torch.randn(count, 2048, generator=generator, device="cuda").bfloat16()
    reference = reference_outputs_and_gradients(experts, tokens, tokens_per_expert, probs, projection)

    def errors(forward) -> list[float]:
        inputs = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        weights = [p for expert in experts.local_experts for p in (expert.linear_fc1.weight, expert.linear_fc2.weight)]
        output, _ = forward(experts, inputs[0], torch.tensor(tokens_per_expert), inputs[1])
        results = [output.detach(), *torch.autograd.grad((output * projection).sum(), [*inputs, *weights])]
        return [float((ours.double() - theirs).norm() / theirs.norm().clamp_min(1e-30))
                for ours, theirs in zip(results, reference) if theirs.norm() > 0]

    grouped, sequential = errors(GroupedExperts.forward), errors(SequentialMLP.forward)
    print("relative errors, grouped:", [f"{e:.2e}" for e in grouped], "sequential:", [f"{e:.2e}" for e in sequential])
    assert max(grouped) < 2e-2  # bfloat16's 8 bits of mantissa, summed over 2048 and 768 terms
    for ours, theirs in zip(grouped, sequential):
        assert ours <= 1.5 * theirs + 1e-3
