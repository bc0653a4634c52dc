"""The Triton Gumbel race (generation/sample_kernel.py), run by Triton's interpreter on the CPU (on a
GPU where there is one): the same tokens as the torch sampler (sampler.sample) for the same
requests, and the log-probs of a float64 log-softmax."""

import pytest
import torch

from aligner_ext.generation import sample_kernel
from aligner_ext.generation.sampler import RACE_CHUNK, request_seed, sample

pytest.importorskip("triton", reason="the CPU build of torch has no Triton; setup_env.sh installs it for these tests")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled for the GPU, else interpreted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_the_torch_samplers_tokens_with_float64_log_probs(dtype):
    if not torch.cuda.is_available():
        assert type(sample_kernel._race_kernel).__name__ == "InterpretedFunction", "TRITON_INTERPRET was set too late"
    torch.manual_seed(0)
    rows, width, temperature = 6, 2 * RACE_CHUNK + 517, 0.7  # three chunks, the last one partial
    logits = (torch.randn(rows, width) * 3).to(dtype).to(DEVICE)
    seeds = torch.tensor([request_seed(11, i) for i in range(rows)], device=DEVICE)
    counters = torch.tensor([0, 1, 2, 3, 50, 1000], device=DEVICE)
    tokens, logprobs = sample_kernel.gumbel_sample(logits, temperature, seeds, counters)
    expected_tokens, _ = sample(logits, temperature, 1.0, 0, seeds, counters)
    assert tokens.dtype == torch.long and torch.equal(tokens, expected_tokens)
    reference = torch.log_softmax(logits.double().cpu() / temperature, dim=-1).gather(-1, tokens.cpu()[:, None])
    torch.testing.assert_close(logprobs.double().cpu(), reference.squeeze(-1), atol=1e-5, rtol=0)
    # another token index draws anew
    assert not torch.equal(sample_kernel.gumbel_sample(logits, temperature, seeds, counters + 1)[0], tokens)


def test_a_compiled_engine_draws_by_the_race_only_without_top_k_or_top_p(monkeypatch):
    from aligner_ext.generation.rollout import _draw

    calls = []
    monkeypatch.setattr(sample_kernel, "gumbel_sample", lambda *args: calls.append("race") or "race")
    torch_sampler = lambda *args: calls.append("torch") or "torch"  # noqa: E731
    logits, seeds = torch.zeros(2, 50), torch.zeros(2, dtype=torch.long)
    draws = [_draw(torch_sampler, logits, 1.0, 1.0, 0, seeds, seeds), _draw(torch_sampler, logits, 0.0, 1.0, 0, seeds, seeds),
             _draw(torch_sampler, logits, 1.0, 0.9, 0, seeds, seeds), _draw(torch_sampler, logits, 1.0, 1.0, 5, seeds, seeds),
             _draw(torch_sampler, logits, 1.0, 1.0, 50, seeds, seeds)]
    assert draws == ["race", "torch", "torch", "torch", "race"]  # top_k >= V filters nothing
