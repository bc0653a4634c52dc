"""The rollout engine on every dense family aligner_ext/architecture.py describes and on Llama with
linear, dynamic and YaRN RoPE scaling (family_models.py): float32 greedy tokens and log-probs equal
to the HF engine's on a ragged batch whose sequences outgrow the sliding window (4), with fewer
slots than requests; Gemma 3 (windowed and global layers with their own RoPE tables) with the Triton
kernel and FlexAttention too.

Sequences stay within 16 positions: Phi-3's LongRoPE tables are the ones transformers uses up to
`original_max_position_embeddings` (16 at this size; aligner_ext/architecture.py's docstring)."""

import pytest

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from family_models import MODELS, family_model

TEXTS = ["hello the", "a", "what i", "xyzxyzxy", "hello the", "Q: na"]  # 9, 1, 6, 8, 9, 5 tokens
MAX_NEW_TOKENS = 7


def assert_same_as_the_hf_engine(model, tokenizer, **rollout):
    prompts = [tokenizer.encode(text) for text in TEXTS]
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, return_logprobs=True)
    expected = HFGenerationEngine(model, tokenizer, HFEngineConfig()).generate(prompts, params)
    engine = RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=4, **rollout))
    outputs = engine.generate(prompts, params)
    assert len({tuple(e.token_ids) for e in expected}) > 2  # the prompts lead somewhere different
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(e.token_ids, e.finish_reason) for e in expected]
    for output, reference in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logprobs_equal_the_hf_engines(tiny_tokenizer, name):
    assert_same_as_the_hf_engine(family_model(name, tiny_tokenizer), tiny_tokenizer)


@pytest.mark.parametrize("attention", ["triton", "flex"])
def test_windowed_layers_decode_with_the_triton_kernel_and_flex_attention(tiny_tokenizer, attention):
    if attention == "triton":
        pytest.importorskip("triton", reason="the CPU build of torch has no Triton; setup_env.sh installs it")
    assert_same_as_the_hf_engine(family_model("gemma3_text", tiny_tokenizer), tiny_tokenizer, attention=attention)
