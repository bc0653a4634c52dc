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
