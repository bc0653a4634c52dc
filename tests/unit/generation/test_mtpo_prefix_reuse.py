"""HF engine `reuse_prompt_prefill`: repeated prompts (MTPO round 2, GRPO groups) are prefilled once
and continue exactly as if each had been prefilled on its own."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine


def prompts_of(tokenizer):
    a, b, c = (tokenizer.encode(text) for text in ("<answer>red</answer>", "Q2 longer prompt", "x"))
    return [a, a, b, a, c, c]  # 3 distinct prompts of different lengths, repeated


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=8, temperature=0.0, return_logprobs=True),
    SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, return_logprobs=True),
])
def test_reuse_gives_the_same_continuations_with_one_prefill_per_distinct_prompt(tiny_tokenizer, tiny_model, params):
    prompts = prompts_of(tiny_tokenizer)
    plain = HFGenerationEngine(tiny_model, tiny_tokenizer, HFEngineConfig()).generate(prompts, params)
    prefill_rows = []
    hook = tiny_model.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape) if kwargs.get(
            "cache", kwargs.get("past_key_values")) is None else None, with_kwargs=True)
    reused = HFGenerationEngine(tiny_model, tiny_tokenizer, HFEngineConfig(reuse_prompt_prefill=True)).generate(
        prompts, params)
    hook.remove()
    assert prefill_rows == [torch.Size([3, max(len(p) for p in prompts)])]  # one forward over the 3 distinct prompts
    assert [o.token_ids for o in reused] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in reused] == [o.finish_reason for o in plain]
    for a, b in zip(reused, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    if params.temperature == 0:  # greedy: the duplicates of a prompt continue identically
        assert reused[0].token_ids == reused[1].token_ids == reused[3].token_ids


class IntCacheLM(nn.Module):
    """A stand-in whose "cache" is an int, so its rows cannot be copied."""

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 8), past_key_values=1)


def test_reuse_needs_a_cache_whose_rows_can_be_copied(tiny_tokenizer):
    engine = HFGenerationEngine(IntCacheLM(), tiny_tokenizer, HFEngineConfig(reuse_prompt_prefill=True))
    with pytest.raises(TypeError, match="reuse_prompt_prefill needs a KV cache with batch_select_indices"):
        engine.generate([[5, 6], [5, 6]], SamplingParams(max_new_tokens=2, temperature=0.0))
    # distinct prompts only: nothing to copy, so the plain path runs
    assert len(engine.generate([[5, 6], [7]], SamplingParams(max_new_tokens=2, temperature=0.0))) == 2
