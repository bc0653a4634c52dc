"""The rollout engine records the experts a mixture of experts' routers chose for every token it feeds
through the model (`SamplingParams.return_routing`, `GenerationOutput.routing`): for each prompt and
generated token, in every layer, the top k that transformers' router takes in a forward of the whole
sequence (captured by a hook on each `mlp.gate`), in float64, where no choice is a near tie
(test_rollout_moe.py draws the routers so). The last generated token, never fed back, is NOT_RECORDED.
Slots reused by later requests, prompts prefilled once for several samples, prefixes copied from the
previous call's kept cache, and a sequence ended by its first token all give the same answer."""

import pytest
import torch

from aligner_ext.generation.base import NOT_RECORDED, SamplingParams
from aligner_ext.generation.decoder import HFDecoder
from aligner_ext.generation.rollout import PREFIX_BLOCK, RolloutEngine, RolloutEngineConfig
from test_rollout_moe import MODELS, TEXTS, moe_model


def transformers_experts(model, ids: list[int]) -> torch.Tensor:
    """[tokens, layers, k] the experts transformers' routers choose for `ids` in one forward."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda router, args, output: chosen.append(output[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


def check_recorded(model, prompts: list[list[int]], outputs) -> None:
    """Each output's routing is transformers' experts for its prompt and response, NOT_RECORDED on the
    response's last token."""
    top_k = model.config.num_experts_per_tok
    for prompt, output in zip(prompts, outputs):
        tokens = prompt + output.token_ids
        assert output.routing.dtype == torch.int16
        assert output.routing.shape == (len(tokens), model.config.num_hidden_layers, top_k)
        assert torch.equal(output.routing[:-1].long(), transformers_experts(model, tokens)[:-1])
        assert (output.routing[-1] == NOT_RECORDED).all()


@pytest.mark.parametrize("name", MODELS)
def test_every_prompt_and_generated_token_has_transformers_experts(tiny_tokenizer, name):
    """Three slots for nine requests (slots taken over as requests finish), a prompt sampled four
    times (prefilled once, its K/V and experts copied to the other slots), stop ids ending sequences
    at different lengths."""
    model = moe_model(name, tiny_tokenizer)
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=3))
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS] + [tiny_tokenizer.encode(TEXTS[0])] * 3
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=5, return_routing=True,
                            stop_token_ids=tiny_tokenizer.encode("abcdefghij"))
    outputs = engine.generate(prompts, params)
    assert len({len(output.token_ids) for output in outputs}) > 2  # sequences of different lengths
    check_recorded(model, prompts, outputs)


def test_a_prefix_kept_from_the_previous_call_brings_its_experts(tiny_tokenizer):
    """MTPO's round 2: prompts extending the previous call's sequences copy their prefixes' K/V and
    experts from the kept cache and prefill only the rest."""
    model = moe_model("qwen3_moe", tiny_tokenizer)
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=4))
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS[:3]]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=6, ignore_eos=True, return_routing=True)
    first = engine.generate(prompts, params)
    continued = [prompt + output.token_ids + tiny_tokenizer.encode("ok") for prompt, output in zip(prompts, first)]
    second = engine.generate(continued, SamplingParams(max_new_tokens=5, temperature=1.0, seed=7, return_routing=True))
    assert engine.last_call["prefix_reused_tokens"] >= len(continued) * PREFIX_BLOCK
    check_recorded(model, continued, second)


def test_a_kept_cache_without_experts_is_not_reused_by_a_call_that_records_them(tiny_tokenizer):
    model = moe_model("qwen3_moe", tiny_tokenizer)
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=4))
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS[:2]]
    first = engine.generate(prompts, SamplingParams(max_new_tokens=14, temperature=1.0, seed=6, ignore_eos=True))
    assert all(output.routing is None for output in first)  # not asked
    continued = [prompt + output.token_ids + tiny_tokenizer.encode("ok") for prompt, output in zip(prompts, first)]
    second = engine.generate(continued, SamplingParams(max_new_tokens=3, temperature=1.0, seed=7, return_routing=True))
    assert engine.last_call["prefix_reused_tokens"] == 0
    check_recorded(model, continued, second)


def test_a_sequence_ended_by_its_first_token_has_its_prompts_experts(tiny_tokenizer):
    model = moe_model("qwen2_moe_shared", tiny_tokenizer)
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig())
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=1.0, return_routing=True))
    assert [len(output.routing) for output in outputs] == [len(prompt) + 1 for prompt in prompts]
    check_recorded(model, prompts, outputs)


def test_a_dense_model_returns_no_routing(tiny_tokenizer, tiny_model):
    engine = RolloutEngine(tiny_model, tiny_tokenizer, RolloutEngineConfig())
    outputs = engine.generate([tiny_tokenizer.encode("hello")], SamplingParams(max_new_tokens=3, return_routing=True))
    assert outputs[0].routing is None and engine.decoder.new_cache(1, 8).routing is None


@pytest.mark.slow
def test_the_compiled_decode_step_records_as_the_eager_one(tiny_tokenizer):
    """torch.compile of the decode layer's functions (the GPU path; here compiled for the CPU) writes the
    step's experts into the same record as the eager step, on caches of two slot counts (the record's
    rows are dynamic, as the cache's)."""
    model = moe_model("qwen2_moe_shared", tiny_tokenizer)
    eager, compiled = HFDecoder(model), HFDecoder(model, compile=True)
    with torch.inference_mode():
        for slots, (ids, positions, attended) in ((4, ([5, 6, 7, 8], [3, 7, 10, 2], 16)),
                                                  (6, ([9, 10, 11, 12, 13], [4, 8, 11, 3, 30], 32))):
            caches = []
            for decoder in (eager, compiled):
                torch.manual_seed(1)
                caches.append(decoder.new_cache(slots, 40, record_routing=True))
                for tensor in (*caches[-1].keys, *caches[-1].values):
                    tensor.normal_()
            ids, positions = torch.tensor(ids), torch.tensor(positions)
            for decoder, cache in zip((eager, compiled), caches):
                decoder.decode(ids, positions, cache, attended)
            rows = torch.arange(len(ids))
            expected = caches[0].routing.history[rows, positions]
            assert torch.equal(caches[1].routing.history[rows, positions], expected)
            assert (expected != 0).any()
