"""The rollout engine (generation/rollout.py) against the HF engine, the reference: float32 greedy
tokens and finishes identical on ragged batches for Llama, Qwen2 and Qwen3 whatever the slot count
and prefill sharing (every family: test_rollout_families.py); sampling that follows the model's
distribution and does not depend on the batch; stops, EOS, stop ids, max tokens and ignore_eos;
clear configuration errors; the compiled decode step, compiled once whatever the cache length; the
cache's length a multiple of 16."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from aligner_ext.config import load_config
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.generation.sampler import RACE_CHUNK, gumbel_argmax, request_seed, uniforms
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

TEXTS = ["hello there", "a", "what is 2+2?", "xyzxyzxyzxyz", "hello there", "Q: name a colour."]


def small_llama(tokenizer):
    shape = TinyModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)
    return build_tiny_model(tokenizer, shape).eval()


def small_qwen(tokenizer, config_class, model_class, **extra):
    torch.manual_seed(2)
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, head_dim=16, tie_word_embeddings=True,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)
    return model_class(config).eval()


def prompts_of(tokenizer, texts=TEXTS):
    return [tokenizer.encode(text) for text in texts]


def rollout(model, tokenizer, **cfg):
    return RolloutEngine(model, tokenizer, RolloutEngineConfig(**cfg))


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("slots,share", [(64, True), (2, True), (3, False)])
def test_greedy_matches_the_hf_engine_on_ragged_prompts(tiny_tokenizer, architecture, slots, share):
    tok = tiny_tokenizer
    model = {"llama": lambda: small_llama(tok),
             "qwen2": lambda: small_qwen(tok, Qwen2Config, Qwen2ForCausalLM),
             "qwen3": lambda: small_qwen(tok, Qwen3Config, Qwen3ForCausalLM)}[architecture]()
    params = SamplingParams(max_new_tokens=16, temperature=0.0, return_logprobs=True)
    expected = HFGenerationEngine(model, tok, HFEngineConfig()).generate(prompts_of(tok), params)
    outputs = rollout(model, tok, max_batch_size=slots, share_prompt_prefill=share).generate(prompts_of(tok), params)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.finish_reason for o in outputs] == [e.finish_reason for e in expected]
    for output, reference in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_sampled_tokens_do_not_depend_on_slots_or_prefill_sharing(tiny_tokenizer):
    model = small_llama(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=11, return_logprobs=True)
    runs = [rollout(model, tiny_tokenizer, max_batch_size=slots, share_prompt_prefill=share)
            .generate(prompts_of(tiny_tokenizer), params) for slots, share in ((64, True), (1, False), (4, True))]
    for other in runs[1:]:
        assert [o.token_ids for o in other] == [o.token_ids for o in runs[0]]
        for output, first in zip(other, runs[0]):
            assert output.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    # the two requests of "hello there" draw from their own streams
    assert runs[0][0].token_ids != runs[0][4].token_ids


def test_seeds_reproduce_and_differ(tiny_tokenizer):
    engine = rollout(small_llama(tiny_tokenizer), tiny_tokenizer)
    prompts = prompts_of(tiny_tokenizer)

    def tokens(seed):
        return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=seed))]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)


def reference_distribution(model, prompt, temperature, top_k, top_p):
    """The next-token distribution after temperature, top-k and top-p, in float64, written out here."""
    with torch.no_grad():
        logits = model.double()(input_ids=torch.tensor([prompt])).logits[0, -1]
    model.float()
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()[:top_k]  # top-k first, then top-p on the k renormalised
    top_k_mass = sum(probs[token].item() for token in order)
    kept, mass = [], 0.0
    for token in order:
        if mass >= top_p:
            break
        kept.append(token)
        mass += probs[token].item() / top_k_mass
    return {token: probs[token].item() / top_k_mass / mass for token in kept}


def test_sampled_first_tokens_follow_the_filtered_distribution(tiny_tokenizer):
    model = small_llama(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("the colour is")
    temperature, top_k, top_p, draws = 1.5, 12, 0.9, 4000
    expected = reference_distribution(model, prompt, temperature, top_k, top_p)
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=1,
                            return_logprobs=True)
    outputs = rollout(model, tiny_tokenizer, max_batch_size=512).generate([prompt] * draws, params)
    counts = {}
    for output in outputs:
        token = output.token_ids[0]
        counts[token] = counts.get(token, 0) + 1
        assert output.logprobs[0] == pytest.approx(math.log(expected[token]), abs=1e-4)
    assert set(counts) <= set(expected)  # never outside the top-k and nucleus set
    # Pearson's chi-square over the kept tokens; with k - 1 degrees of freedom it has mean k - 1 and
    # variance 2(k - 1): six standard deviations above the mean is a failure far beyond chance
    chi_square = sum((counts.get(t, 0) - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    freedom = len(expected) - 1
    assert freedom >= 3
    assert chi_square < freedom + 6 * math.sqrt(2 * freedom)


def test_stops_eos_stop_ids_length_and_ignore_eos_match_the_hf_engine(tiny_tokenizer):
    tok = tiny_tokenizer
    model = small_llama(tok)
    prompts = prompts_of(tok)
    free_run = HFGenerationEngine(model, tok, HFEngineConfig()).generate(
        prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
    first = free_run[0].token_ids
    # a stop string made of generated tokens 3-4 of the first prompt, and token 6 of the second as a stop id
    stop_text = tok.decode(first[3:5])
    stop_id = free_run[2].token_ids[6]
    for params in (SamplingParams(max_new_tokens=16, temperature=0.0, stop=[stop_text], stop_token_ids=[stop_id]),
                   SamplingParams(max_new_tokens=5, temperature=0.0)):
        expected = HFGenerationEngine(model, tok, HFEngineConfig()).generate(prompts, params)
        outputs = rollout(model, tok, max_batch_size=3).generate(prompts, params)
        assert [(o.token_ids, o.finish_reason) for o in outputs] == [(e.token_ids, e.finish_reason) for e in expected]
    stopped = rollout(model, tok).generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                    stop=[stop_text]))
    assert stopped[0].finish_reason == "stop" and tok.decode(stopped[0].token_ids).endswith(stop_text)
    assert len(stopped[0].token_ids) <= 5
    # EOS: make the last of the first prompt's greedy tokens the end-of-sequence id
    model.generation_config.eos_token_id = first[-1]
    engine = rollout(model, tok)
    ended = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0))
    end = first.index(first[-1]) + 1
    assert (ended[0].token_ids, ended[0].finish_reason) == (first[:end], "eos")
    kept_on = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    assert (kept_on[0].token_ids, kept_on[0].finish_reason) == (first, "length")


def test_the_cache_length_is_a_multiple_of_16_whatever_the_prompt_width(tiny_tokenizer, widths_padded_on_the_cpu):
    """Prompts of 8 and 9 tokens with 8 new tokens (16 and 17 positions) get caches of 16 and 32
    positions: the decode-attention kernel sees one pattern of the cache length's divisibility and
    compiles nothing for a new prompt width (aligner_ext/widths.py); the tokens stay the HF engine's."""
    model = small_llama(tiny_tokenizer)
    engine = rollout(model, tiny_tokenizer, max_batch_size=2)
    lengths = []
    new_cache = engine.decoder.new_cache
    engine.decoder.new_cache = lambda slots, length, *rest: lengths.append(length) or new_cache(slots, length, *rest)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    hf = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    for prompts in (prompts_of(tiny_tokenizer, ["ab", "abcdefgh"]), prompts_of(tiny_tokenizer, ["abcdefghi", "a"])):
        assert max(map(len, prompts)) in (8, 9)  # one token per character
        expected = [output.token_ids for output in hf.generate(prompts, params)]
        assert [output.token_ids for output in engine.generate(prompts, params)] == expected
    assert lengths == [16, 32]


def test_the_engine_samples_the_current_weights_without_a_copy(tiny_tokenizer):
    model = small_llama(tiny_tokenizer)
    engine = rollout(model, tiny_tokenizer)
    prompt = prompts_of(tiny_tokenizer)[:1]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(prompt, params)[0].token_ids
    torch.manual_seed(3)
    with torch.no_grad():  # an "optimizer step", in place
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    after = engine.generate(prompt, params)[0].token_ids
    assert after != before
    assert after == HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig()).generate(prompt, params)[0].token_ids


def test_counter_based_uniforms():
    seeds = torch.tensor([request_seed(7, i) for i in range(200)])
    values = uniforms(seeds, torch.zeros_like(seeds), 50)  # 10,000 numbers
    assert values.shape == (200, 50) and values.dtype == torch.float32
    assert values.min() > 0 and values.max() < 1
    assert len(set(values.flatten().tolist())) > 9970  # 23 bits: a few collisions by chance (birthday: ~6)
    assert abs(values.mean().item() - 0.5) < 0.0116  # 4 standard errors of the mean (0.0029)
    assert abs(values.var().item() - 1 / 12) < 0.004  # uniform variance 1/12; its standard error ~0.0008
    # entry (b, i) depends on (seed, counter, i) only: the same with another width, new for the next token
    assert torch.equal(values, uniforms(seeds, torch.zeros_like(seeds), 50))
    assert torch.equal(uniforms(seeds, torch.zeros_like(seeds), 25), values[:, :25])
    following = uniforms(seeds, torch.ones_like(seeds), 50)
    assert (following != values).float().mean() > 0.999


def test_the_two_stage_race_over_a_large_vocabulary_is_the_one_stage_argmax_and_samples_p():
    width = 2 * RACE_CHUNK + 904  # three chunks, the last one padded
    rows = 3000
    seeds = torch.tensor([request_seed(3, i) for i in range(rows)])
    counters = torch.full((rows,), 4)
    probs = torch.full((width,), 1e-12)
    probs[[10, RACE_CHUNK + 52, width - 1]] = torch.tensor([0.5, 0.3, 0.2])  # one likely token per chunk
    scores = probs.log().expand(rows, width).contiguous()
    tokens = gumbel_argmax(scores, seeds, counters)
    noise = -torch.log(-torch.log(uniforms(seeds, counters, width)))
    assert torch.equal(tokens, (scores + noise).argmax(dim=-1))
    counts = torch.bincount(tokens, minlength=width)[[10, RACE_CHUNK + 52, width - 1]].double()
    assert counts.sum() == rows
    expected = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) * rows
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 2 + 6 * 2  # 2 degrees of freedom: mean 2, standard deviation 2


def test_configuration_errors(tiny_tokenizer):
    model = small_llama(tiny_tokenizer)
    for override, message in (("max_batch_size=0", "max_batch_size=0: must be a finite number >= 1"),
                              ("kv_cache_memory_share=0.0", "kv_cache_memory_share=0: must be a finite number > 0"),
                              ("attention=flash", "attention='flash': must be one of auto, sdpa, flex")):
        with pytest.raises(ValueError, match=f"^generator.rollout.{message}"):
            load_config("base", [f"generator.rollout.{override}"])
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="generator.engine=hf"):
        rollout(gpt2, tiny_tokenizer)
    with pytest.raises(ValueError, match="top_k"):
        rollout(model, tiny_tokenizer).generate([[5]], SamplingParams(top_k=-1))


def test_auto_attention_is_the_triton_kernel_on_a_gpu_with_triton_and_sdpa_elsewhere(monkeypatch):
    from aligner_ext.generation import decode_attention
    from aligner_ext.generation.decoder import resolve_attention

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(decode_attention, "available", lambda: True)
    assert (resolve_attention("auto", gpu), resolve_attention("auto", cpu)) == ("triton", "sdpa")
    assert resolve_attention("flex", gpu) == "flex"
    monkeypatch.setattr(decode_attention, "available", lambda: False)
    assert resolve_attention("auto", gpu) == "sdpa"
    with pytest.raises(ValueError, match="needs the triton package"):
        resolve_attention("triton", gpu)


def test_fused_projections_view_the_policy_parameters_which_still_train_and_save(tiny_tokenizer, tmp_path):
    """q/k/v (with Qwen2's biases) and gate/up become views of one buffer per group: an AdamW step
    through the parameters is what the engine computes next, a safetensors round trip keeps every
    value, and a `model.to` that reallocates the parameters is fused again before the next call."""
    from safetensors.torch import save_model

    from aligner_ext.generation.decoder import fused_buffer
    from aligner_ext.trainer.checkpoint import load_weights, save_weights

    model = small_qwen(tiny_tokenizer, Qwen2Config, Qwen2ForCausalLM)
    unfused_copy = {name: value.clone() for name, value in model.state_dict().items()}
    engine = rollout(model, tiny_tokenizer)
    attn = model.model.layers[0].self_attn
    qkv = fused_buffer([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert qkv is not None and qkv.shape == (64 + 2 * 32, 64)
    assert fused_buffer([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
    assert engine.decoder.layers[0].qkv.weights[0].data_ptr() == attn.q_proj.weight.data_ptr()
    # Fusing moved no value.
    for name, value in model.state_dict().items():
        assert torch.equal(value, unfused_copy[name]), name
    prompt, params = prompts_of(tiny_tokenizer)[:2], SamplingParams(max_new_tokens=8, temperature=0.0)
    hf = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    before = engine.generate(prompt, params)

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    logits = model(input_ids=torch.tensor([prompt[0]])).logits
    logits.float().pow(2).mean().backward()
    optimizer.step()
    assert attn.k_proj.weight.grad is not None and fused_buffer([attn.q_proj.weight, attn.k_proj.weight,
                                                                 attn.v_proj.weight]) is not None
    after = engine.generate(prompt, params)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert [o.token_ids for o in after] == [o.token_ids for o in hf.generate(prompt, params)]

    save_weights(model, tmp_path / "model.safetensors")
    reloaded = small_qwen(tiny_tokenizer, Qwen2Config, Qwen2ForCausalLM)
    rollout(reloaded, tiny_tokenizer)  # loading into a fused model writes through its views
    assert load_weights(reloaded, tmp_path / "model.safetensors") == ([], [])
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    # Weights saved by safetensors' save_model (tied embedding under one name) load too.
    plain = small_qwen(tiny_tokenizer, Qwen2Config, Qwen2ForCausalLM)
    save_model(plain, str(tmp_path / "plain.safetensors"))
    assert load_weights(reloaded, tmp_path / "plain.safetensors") == ([], [])
    assert torch.equal(reloaded.lm_head.weight, plain.lm_head.weight)
    assert torch.equal(reloaded.model.layers[0].self_attn.v_proj.bias, plain.model.layers[0].self_attn.v_proj.bias)

    model.to(torch.float64)  # every parameter reallocated: the engine fuses them again
    assert fused_buffer([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None
    again = engine.generate(prompt, params)
    mlp = model.model.layers[1].mlp
    assert fused_buffer([mlp.gate_proj.weight, mlp.up_proj.weight]).dtype == torch.float64
    assert [o.token_ids for o in again] == [o.token_ids for o in hf.generate(prompt, params)]


def test_fused_and_separate_projections_give_the_same_tokens(tiny_tokenizer):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, return_logprobs=True)
    separate = rollout(small_llama(tiny_tokenizer), tiny_tokenizer, fuse_projections=False)
    fused = rollout(small_llama(tiny_tokenizer), tiny_tokenizer)
    assert len(separate.decoder.layers[0].qkv.weights) == 3 and len(fused.decoder.layers[0].qkv.weights) == 1
    expected = separate.generate(prompts_of(tiny_tokenizer), params)
    outputs = fused.generate(prompts_of(tiny_tokenizer), params)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    for output, reference in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_flex_attention_decodes_the_hf_engine_greedy_tokens(tiny_tokenizer):
    model = small_qwen(tiny_tokenizer, Qwen2Config, Qwen2ForCausalLM)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprobs=True)
    expected = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig()).generate(prompts_of(tiny_tokenizer), params)
    outputs = rollout(model, tiny_tokenizer, attention="flex", max_batch_size=3).generate(prompts_of(tiny_tokenizer), params)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    for output, reference in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "olmo3", "smollm3"])
def test_the_compiled_decode_step_writes_the_cache_and_computes_as_the_eager_one(tiny_tokenizer, family):
    """torch.compile of the decode layer's functions (the GPU path; here compiled for the CPU): the same
    logits and the same cache, written in place at each row's position and nowhere else. OLMo 3: the
    post-MLP norm applied in the next layer's function, q/k norms over the whole projection; SmolLM3:
    a layer without RoPE (no tables)."""
    from family_models import family_model, random_cache_pair

    from aligner_ext.generation.decoder import HFDecoder

    model = small_llama(tiny_tokenizer) if family == "llama" else family_model(family, tiny_tokenizer)
    eager, compiled = HFDecoder(model), HFDecoder(model, compile=True)
    caches = random_cache_pair(eager)
    before = [tensor.clone() for tensor in caches[1].keys]
    with torch.inference_mode():
        for ids, positions, attended in (([5, 6, 7, 8], [3, 7, 10, 2], 16), ([9, 10, 11, 12, 13], [4, 8, 11, 3, 30], 32)):
            ids, positions = torch.tensor(ids), torch.tensor(positions)
            expected = eager.decode(ids, positions, caches[0], attended)
            torch.testing.assert_close(compiled.decode(ids, positions, caches[1], attended), expected, atol=1e-5, rtol=0)
    for mine, reference in zip((*caches[1].keys, *caches[1].values), (*caches[0].keys, *caches[0].values)):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)
    written = torch.zeros(6, 40, dtype=torch.bool)
    written[[0, 1, 2, 3], [3, 7, 10, 2]] = written[[0, 1, 2, 3, 4], [4, 8, 11, 3, 30]] = True
    changed = (caches[1].keys[0] != before[0]).any(dim=-1).any(dim=1)  # [slots, length]
    assert torch.equal(changed, written)


@pytest.mark.slow
def test_the_compiled_decode_step_compiles_nothing_for_a_new_cache_length_slot_count_or_row_count(tiny_tokenizer):
    """A new prompt width gives a call's cache another length (a new batch another slot count): the
    decode step's compiled functions take those dimensions, and the rows, as dynamic from their first
    call (`compile_varying`), so no call after the first compiles a graph (the GPU path; here for the CPU)."""
    from torch._dynamo.utils import counters

    from aligner_ext.generation.decoder import HFDecoder

    decoder = HFDecoder(small_llama(tiny_tokenizer), compile=True)
    graphs = []
    with torch.inference_mode():
        for slots, length, rows in ((8, 32, 8), (8, 48, 4), (12, 80, 12), (6, 112, 2)):
            decoder.decode(torch.arange(rows) + 5, torch.arange(rows) + 3, decoder.new_cache(slots, length), length)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 3


@pytest.mark.slow
def test_the_compiled_sampler_draws_the_eager_samplers_tokens_at_any_row_count():
    from aligner_ext.generation.sampler import sample

    compiled = torch.compile(sample, dynamic=True)  # as the engine compiles it on a GPU
    torch.manual_seed(0)
    for rows in (5, 9, 3):
        logits = torch.randn(rows, 300)
        seeds, counters = torch.arange(rows) * 7919, torch.arange(rows) + 2
        tokens, logprobs = compiled(logits, 0.7, 1.0, 0, seeds, counters)
        expected_tokens, expected_logprobs = sample(logits, 0.7, 1.0, 0, seeds, counters)
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)


def test_a_finished_calls_decode_graphs_do_not_keep_it_alive():
    """The CUDA graphs of a call hold its batcher's decode step weakly: a strong reference closed a cycle that
    only a full collection freed, so on a GPU every finished call's KV cache stayed allocated (5.25 GiB a step at
    1.5B) until one ran. With the cyclic collector off, dropping the batcher must free it and its graphs."""
    import gc
    import weakref

    from aligner_ext.generation.batching import _DecodeGraphs

    class Batcher:
        def step(self, rows: int, attended: int) -> None:
            pass

    batcher = Batcher()
    batcher.graphs = _DecodeGraphs(batcher.step, slots=None, count=16, warmed=set(), context=())
    freed, graphs_freed = weakref.ref(batcher), weakref.ref(batcher.graphs)
    gc.disable()
    try:
        del batcher
        assert freed() is None and graphs_freed() is None
    finally:
        gc.enable()
