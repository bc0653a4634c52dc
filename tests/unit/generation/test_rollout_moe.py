"""The rollout engine on mixtures of experts (generation/decoder.py::experts_mlp): Qwen3-MoE with its
top-k weights renormalised and not, Qwen2-MoE with its gated shared expert. Expected values come
from transformers' own modules: in float64 the decode step's log-probs equal the model's forward on
a ragged batch to 1e-10 (with the K/V the prefill wrote for every layer, so the prefill's MLPs too);
the router picks the experts transformers' router picks, with the same weights, in every dtype; in
bfloat16 the grouped product (`torch._grouped_mm`) gives transformers' grouped experts' output bit
for bit, in float32 the gathered one agrees to rounding; float32 greedy tokens equal the HF engine's;
LoRA on the attention and the shared expert equals peft's forward, and on the shared expert's gate is
refused; the compiled decode step computes as the eager one.

The routers' weights are drawn at a scale where each token's k-th and (k+1)-th experts are far apart
(checked), so rounding differences between implementations cannot swap an expert in or out."""

import pytest
import torch
from family_models import drawn_lora_b, random_cache_pair

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.decoder import (
    HFDecoder,
    experts_mlp,
    grouped_mm_runs,
    route,
    weighted_expert_sum,
)
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.family_configs import (
    decisive_experts,
    family_config,
    random_model,
)
from aligner_ext.models.lora import attach
from aligner_ext.models.settings import LoraConfig

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=64)
# name -> (family, config overrides)
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3_moe_unnormalised": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen2_moe_shared": ("qwen2_moe", dict(shared_expert_intermediate_size=24, norm_topk_prob=False)),
}
TEXTS = ["hello the", "a", "what i", "xyzxyzxy", "hello the", "Q: na"]  # 9, 1, 6, 8, 9, 5 tokens


def moe_model(name: str, tokenizer, dtype: torch.dtype = torch.float64):
    """The tiny model of MODELS[name] in `dtype`, its routers and experts drawn large enough that the
    experts decide the outputs and no token's choice is a near tie. transformers' grouped experts take
    no float64: in float64 its loop over the experts runs."""
    family, overrides = MODELS[name]
    config = family_config(family, **SIZES, **overrides, vocab_size=len(tokenizer),
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = random_model(config)
    decisive_experts(model, 0.2)
    model = model.to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


def mlp_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE block's input [tokens, h] in transformers' forward of `ids`."""
    captured = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda module, args: captured.append(args[0].flatten(0, -2)))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return captured


@pytest.mark.parametrize("name", MODELS)
def test_decode_logprobs_equal_the_models_forward_on_a_ragged_batch(tiny_tokenizer, name):
    """The prompts prefilled together (right-padded), then 4 tokens decoded for all rows at once, each
    row at its own position: every step's log-probs are transformers' float64 forward of the whole
    sequence; the prefill's own logits (float32, as the engine samples them) to float32 rounding."""
    model = moe_model(name, tiny_tokenizer)
    decoder = HFDecoder(model)
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    steps = 4
    gen = torch.Generator().manual_seed(2)
    continuations = torch.randint(0, len(tiny_tokenizer), (len(prompts), steps), generator=gen)
    with torch.no_grad():
        expected = [torch.log_softmax(model(input_ids=torch.tensor([prompt + tail.tolist()])).logits[0], -1)
                    for prompt, tail in zip(prompts, continuations)]
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    cache = decoder.new_cache(len(prompts), int(lengths.max()) + steps)
    rows = torch.arange(len(prompts))
    with torch.inference_mode():
        logits = decoder.prefill(ids, lengths, rows, cache, torch.zeros_like(lengths))
        first = torch.stack([reference[length - 1] for reference, length in zip(expected, lengths)])
        torch.testing.assert_close(torch.log_softmax(logits, -1), first.float(), atol=1e-5, rtol=0)
        for step in range(steps):
            positions = lengths + step
            logits = decoder.decode(continuations[:, step], positions, cache, int(positions.max()) + 1)
            assert logits.dtype == torch.float64
            wanted = torch.stack([reference[position] for reference, position in zip(expected, positions)])
            torch.testing.assert_close(torch.log_softmax(logits, -1), wanted, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODELS)
def test_the_router_picks_transformers_experts_with_its_weights(tiny_tokenizer, name, dtype):
    model = moe_model(name, tiny_tokenizer, dtype)
    ids = torch.tensor([tiny_tokenizer.encode("what is the colour of a xyz? hello there")])
    top_k = model.config.num_experts_per_tok
    used = set()
    for layer, hidden in zip(model.model.layers, mlp_inputs(model, ids)):
        with torch.no_grad():
            _, expected_weights, expected_experts = layer.mlp.gate(hidden)
            weights, experts = route(hidden, layer.mlp.gate.weight, top_k, model.config.norm_topk_prob)
        assert torch.equal(experts, expected_experts) and torch.equal(weights, expected_weights)
        assert weights.dtype == dtype
        ranked = (hidden.double() @ layer.mlp.gate.weight.double().T).sort(dim=-1, descending=True).values
        assert (ranked[:, top_k - 1] - ranked[:, top_k]).min() > 1e-3  # no near tie: the choice is well defined
        used |= set(experts.flatten().tolist())
    assert len(used) > top_k  # the tokens go to different experts


@pytest.mark.parametrize("dtype, grouped", [(torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("name", MODELS)
def test_the_experts_output_is_transformers_sparse_blocks(tiny_tokenizer, name, dtype, grouped):
    """bfloat16: `torch._grouped_mm`, the same kernel and order of operations as transformers' default
    (`grouped_mm`) experts, so the same bits; float32: the gathered products, to float32 rounding."""
    model = moe_model(name, tiny_tokenizer, dtype)
    decoder = HFDecoder(model)
    x = torch.randn(3, 5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(3)).to(dtype)
    for layer, weights in zip(model.model.layers, decoder.layers):
        assert grouped_mm_runs(x, weights.experts) == grouped
        with torch.no_grad():
            out, expected = experts_mlp(x, weights.experts, decoder.shape), layer.mlp(x)
        if grouped:
            assert torch.equal(out, expected)
        else:
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype, grouped", [(torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_expert_parallel_ranks_shares_add_up_to_transformers_experts(tiny_tokenizer, ranks, dtype, grouped):
    """Under expert parallelism (`ExpertExchange`) each rank sums the pairs of its slice of the experts
    only, the others skipped: in bfloat16 sorted past the grouped products' last group (the kernel
    leaves their rows uninitialised), in float32 computed with expert 0 and dropped. The ranks' sums
    add up to transformers' experts module's output for the same routing; a padded row (expert -1,
    no rank's) gets nothing."""
    model = moe_model("qwen3_moe", tiny_tokenizer, dtype)
    decoder = HFDecoder(model)
    x = torch.randn(12, SIZES["hidden_size"], generator=torch.Generator().manual_seed(5)).to(dtype)
    local = SIZES["num_experts"] // ranks
    act = torch.nn.functional.silu
    for layer, weights in zip(model.model.layers, decoder.layers):
        experts = weights.experts
        assert grouped_mm_runs(x, experts) == grouped
        with torch.no_grad():
            top, chosen = route(x, experts.router, experts.top_k, experts.normalize_top_k)
            expected = layer.mlp.experts(x, chosen, top)
            padded_top, padded_chosen = torch.cat([top, top[:1]]), torch.cat([chosen, torch.full_like(chosen[:1], -1)])
            shares = [weighted_expert_sum(torch.cat([x, x[:1]]), padded_top, padded_chosen,
                                          experts._replace(gate_up=experts.gate_up[rank * local : (rank + 1) * local],
                                                           down=experts.down[rank * local : (rank + 1) * local]),
                                          act, rank * local)
                      for rank in range(ranks)]
        held = [((padded_chosen >= rank * local) & (padded_chosen < (rank + 1) * local)).any(dim=-1)
                for rank in range(ranks)]
        assert not all(mine.all() for mine in held)  # some rank holds none of some token's experts
        for share, mine in zip(shares, held):  # it adds exactly 0 there (no uninitialised row leaks)
            assert torch.equal(share[~mine], torch.zeros_like(share[~mine]))
        total = torch.stack(shares).sum(dim=0)
        torch.testing.assert_close(total[:-1], expected, **({} if grouped else dict(atol=1e-6, rtol=1e-5)))


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logprobs_equal_the_hf_engines(tiny_tokenizer, name):
    model = moe_model(name, tiny_tokenizer, torch.float32)
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    params = SamplingParams(max_new_tokens=7, temperature=0.0, return_logprobs=True)
    expected = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig()).generate(prompts, params)
    outputs = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=4)).generate(prompts, params)
    assert len({tuple(e.token_ids) for e in expected}) > 2  # the prompts lead somewhere different
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(e.token_ids, e.finish_reason) for e in expected]
    for output, reference in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def adapted(tokenizer, target_modules: list[str]):
    """Qwen2-MoE in float64 with rank-4 adapters on `target_modules`, B drawn away from its zero start."""
    model = moe_model("qwen2_moe_shared", tokenizer)
    peft_model = attach(model, LoraConfig(rank=4, alpha=8.0, target_modules=target_modules))
    drawn_lora_b(model, seed=4)
    return model.eval(), peft_model


@pytest.mark.parametrize("fuse", [True, False])
def test_lora_on_the_attention_and_the_shared_expert_equals_pefts_forward(tiny_tokenizer, fuse):
    """The default targets (`.*_proj`) take the attention's and the shared expert's projections (the
    routed experts are stacked tensors, not linear layers)."""
    model, peft_model = adapted(tiny_tokenizer, [".*_proj"])
    assert any(".shared_expert.gate_proj.lora_A" in name for name, _ in model.named_parameters())
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=3, fuse_projections=fuse))
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS[:4]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, return_logprobs=True, ignore_eos=True)
    for prompt, output in zip(prompts, engine.generate(prompts, params)):
        ids = torch.tensor([prompt + output.token_ids])
        with torch.no_grad():
            logits = peft_model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(output.token_ids)[:, None])[:, 0]
        assert output.logprobs == pytest.approx(expected.tolist(), abs=2e-6)  # the sampler's float32


def test_an_adapter_on_the_shared_experts_gate_is_refused(tiny_tokenizer):
    model, _ = adapted(tiny_tokenizer, [".*_proj", "shared_expert_gate"])
    with pytest.raises(ValueError, match=r"not on .*mlp\.shared_expert_gate .*generator\.engine=hf runs it"):
        RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig())


@pytest.mark.slow
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-6), (torch.bfloat16, 2e-2)])
def test_the_compiled_decode_step_computes_as_the_eager_one(tiny_tokenizer, dtype, atol):
    """torch.compile of the decode layer's functions (the GPU path; here compiled for the CPU), with the
    gathered products (float64) and `torch._grouped_mm` (bfloat16). The routing weights' float32
    softmax, fused differently, rounds differently: agreement to float32's precision in float64."""
    model = moe_model("qwen2_moe_shared", tiny_tokenizer, dtype)
    eager, compiled = HFDecoder(model), HFDecoder(model, compile=True)
    caches = random_cache_pair(eager)
    with torch.inference_mode():
        for ids, positions, attended in (([5, 6, 7, 8], [3, 7, 10, 2], 16), ([9, 10, 11, 12, 13], [4, 8, 11, 3, 30], 32)):
            ids, positions = torch.tensor(ids), torch.tensor(positions)
            expected = eager.decode(ids, positions, caches[0], attended)
            torch.testing.assert_close(compiled.decode(ids, positions, caches[1], attended), expected, atol=atol, rtol=0)
