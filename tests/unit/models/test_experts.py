"""The HF backend's compiled expert products (models/experts.py): registered with transformers'
ExpertsInterface and set on the model's config, the same values as transformers' `grouped_mm` and eager
experts; the compiled path itself runs only on a GPU (its CUDA test runs there)."""

import copy

import pytest
import torch
from test_moe import moe_model

from aligner_ext.models import experts
from aligner_ext.models.family_configs import family_config


def loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = logits.float().log_softmax(-1).gather(-1, ids[..., None]).sum()
    loss.backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_the_models_experts_take_the_implementation_and_keep_their_values(kind):
    reference = moe_model(kind)  # float32: grouped_mm takes no float64
    reference.set_experts_implementation("eager")  # transformers' loop over experts: an independent path
    model = copy.deepcopy(reference)
    model.set_experts_implementation("grouped_mm")
    assert experts.compile_experts(model)
    assert model.config._experts_implementation == experts.IMPLEMENTATION
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    logits, grads = loss_and_grads(model, ids)  # on the CPU: transformers' function as it is
    want_logits, want_grads = loss_and_grads(reference, ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() and any("experts" in name for name in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-5)


def test_a_model_transformers_does_not_dispatch_through_grouped_mm_is_left_alone():
    model = moe_model()
    model.set_experts_implementation("eager")
    assert not experts.compile_experts(model)
    assert model.config._experts_implementation == "eager"


def compiled_against_transformers(device: str) -> list[tuple[float, float]]:
    """One experts module on fixed routing: the relative errors of the compiled function's and of
    transformers' `grouped_mm` outputs and gradients in bf16 against transformers' eager experts in
    float32 (output, input, routing weights, gate_up_proj, down_proj)."""
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = family_config("qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to(device)
    for weight in (module.gate_up_proj, module.down_proj):
        torch.nn.init.normal_(weight, std=0.05)
    hidden32 = torch.randn(700, 256, device=device)
    chosen = torch.rand(700, 16, device=device).topk(4, dim=-1).indices
    weights32 = torch.rand(700, 4, device=device).softmax(-1)
    grad = torch.randn(700, 256, device=device)

    def run(forward, dtype: torch.dtype, implementation: str = "grouped_mm") -> list[torch.Tensor]:
        experts_ = copy.deepcopy(module).to(dtype)
        experts_.config._experts_implementation = implementation
        hidden = hidden32.detach().to(dtype).requires_grad_()
        weights = weights32.detach().to(dtype).requires_grad_()
        out = forward(experts_, hidden, chosen, weights)
        out.backward(grad.to(dtype))
        return [t.detach().float() for t in (out, hidden.grad, weights.grad, experts_.gate_up_proj.grad, experts_.down_proj.grad)]

    exact = run(lambda experts_, *inputs: experts_(*inputs), torch.float32, "eager")
    ours = run(experts.compiled_grouped_mm(), torch.bfloat16)
    theirs = run(grouped_mm_experts_forward, torch.bfloat16)
    return [tuple(float((value - want).norm() / want.norm()) for value in pair)
            for *pair, want in zip(ours, theirs, exact)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path runs on a GPU")
def test_the_compiled_experts_are_as_close_as_transformers_grouped_mm_on_the_gpu():
    """(A whole model's bf16 routing flips near ties between any two implementations: fixed routing here.)"""
    for error, their_error in compiled_against_transformers("cuda"):
        assert error < 1e-2 and error <= 1.5 * their_error + 1e-3, (error, their_error)
