"""The rollout engine on the Megatron GPTModel's own shards (models/megatron/decoder.py), on CPU under
torchrun (gloo), against the HF model the shards were cut from. Prompts of 1 to 9 tokens and 7 new
tokens: sequences outgrow the families' sliding window (4) and stay within Phi-3's 16 positions of
short LongRoPE factors (aligner_ext/architecture.py).

- TP=2, every case of megatron_cases.py (every dense family: windows, per-layer RoPE tables, NoPE
  layers, post- and sandwich norms, OLMo's q/k norms over the whole projection, whose mean of squares
  is summed over the TP group): float32 greedy tokens and finishes identical to the HF engine's on
  ragged prompts, with 3 slots for 6 requests (continuous batching), log-probs within 1e-5 (float32
  sums in another order); sampled tokens identical to the rollout engine's on the HF model with the
  same seed; both ranks return the same outputs; each TP rank caches only its own K/V heads.
- TP=1 (DP=2) and TP=2 with the Triton decode attention (the default on a GPU; Triton's interpreter
  here), for Llama (tied embeddings), Qwen2 (q/k/v biases), Qwen3 (q/k norms) (`LAYOUT_CASES`), and
  Gemma 3 with Triton: the same.
- TP=2 x DP=2 (4 processes) with the trainer's rank split over the data-parallel group: the two
  ranks of a TP pair decode the same share with the same seed, so every rank returns, in order,
  what the HF model's rollout engine samples for each share with that share's seed.
- PP=2 (2 processes): each rank holds one stage and gathers the other's weights in memory
  (`PipelineGather`): the same greedy and sampled outputs as the HF model; after every parameter is
  scaled by 1.01 and `refresh` runs, the greedy outputs and log-probs of the equally scaled HF
  model (stale copies of the other stage would give the old log-probs); with the rank split the
  two pipeline ranks decode one share each.

- Mixtures of experts (Qwen3-MoE: top-k renormalised; Qwen2-MoE: pre-softmax top-k, a gated shared
  expert; routers and experts redrawn by `decisive_experts`, so no choice is a near tie) at TP=1
  (DP=2), TP=2 with sequence parallelism (as they train at TP > 1) and PP=2: the same greedy, sampled
  and, with PP, after-the-change outputs as above; the experts recorded with `return_routing` equal
  those the rollout engine records on the HF model; only this stage's stacked experts are copies.
  Without a launch: `route` picks megatron-core's router's experts with its weights.
- Expert parallelism (EP=2: each rank holds 2 of the 4 experts, and each MoE layer trades tokens
  over the EP group) at TP=1, at TP=2 with sequence parallelism x EP=2 and at PP=2 x EP=2 (4
  processes): the EP ranks decode different prompts (4 in 3 slots, and 1) for different lengths (7
  and 3 tokens), and then 2 and none, in lockstep: greedy tokens and log-probs equal the HF engine's
  on each rank's prompts, the recorded experts transformers' routers' choice for each token; the
  trainer's rank split of 5 prompts samples each share as the HF model's rollout engine does; after
  every parameter is scaled by 1.01, the equally scaled HF model's greedy outputs.

Two torchrun launches (rollout_worker.py): every 2-process layout, then the 4-process ones. A case
the Megatron backend refuses to build is skipped, naming the refusal.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.distributed import share  # noqa: E402
from aligner_ext.generation.base import SamplingParams  # noqa: E402
from aligner_ext.generation.decoder import route  # noqa: E402
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine  # noqa: E402
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig  # noqa: E402
from aligner_ext.generation.sharded import rank_seed  # noqa: E402
from aligner_ext.models.tiny import build_char_tokenizer  # noqa: E402
from aligner_ext.models.family_configs import decisive_experts  # noqa: E402
from megatron_cases import MOE_CASES, build_model, hf_configs, torchrun  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("rollout_worker.py")
TEXTS = ["hello the", "a", "what i", "xyzxyzxy", "hello the", "Q: na"]  # 9, 1, 6, 8, 9, 5 tokens
GREEDY = SamplingParams(max_new_tokens=7, temperature=0.0, return_logprobs=True)  # as rollout_worker.py's
SAMPLED = SamplingParams(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=7, return_logprobs=True)
LAYOUT_CASES = ["llama", "qwen2", "qwen3"]
DENSE_CASES = sorted(set(hf_configs()) - set(MOE_CASES))
# layout -> cases; tp1 is DP=2; tp2_split needs 4 processes (TP=2 x DP=2), and so do TP=2 or PP=2 x EP=2;
# a mixture of experts at TP=2 is built with sequence parallelism (tp2_sp), as it trains
RUNS = {"tp2": DENSE_CASES, "tp2_sp": list(MOE_CASES), "tp2_triton": [*LAYOUT_CASES, "gemma3_text"],
        "tp1": [*LAYOUT_CASES, *MOE_CASES], "tp1_pp2": [*LAYOUT_CASES, *MOE_CASES], "tp1_pp2_split": LAYOUT_CASES,
        "tp1_ep2": list(MOE_CASES), "tp2_split": LAYOUT_CASES, "tp2_ep2_sp": list(MOE_CASES),
        "tp1_pp2_ep2": list(MOE_CASES)}
FOUR_PROCESSES = ("tp2_split", "tp2_ep2_sp", "tp1_pp2_ep2")
GENERATION = [(name, layout) for layout in ("tp2", "tp2_sp", "tp2_triton", "tp1") for name in RUNS[layout]]
ROUTED = SamplingParams(max_new_tokens=7, temperature=0.0, return_routing=True)  # as rollout_worker.py's
EP_SHARES = {0: (0, 4, 7), 1: (4, 5, 3)}  # as rollout_worker.py's: EP rank -> (first prompt, end, max_new_tokens)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_rollout")
    tokenizer = build_char_tokenizer()
    torch.save([tokenizer.encode(text) for text in TEXTS], root / "prompts.pt")
    for name, config in hf_configs().items():
        config.eos_token_id = tokenizer.eos_token_id
        if not hasattr(type(config)(), "sliding_window"):
            # a field the family does not have: transformers' KV cache (the HF engine's) would read it
            # as a window that the family's attention never applies
            vars(config).pop("sliding_window", None)
        if name in MOE_CASES:
            config.vocab_size += 16  # above the character tokenizer's 101 ids
        model = build_model(config)
        if name in MOE_CASES:
            decisive_experts(model, 0.2)  # no token's choice of experts a near tie
        model.save_pretrained(root / name)
    for processes, layouts in ((2, [layout for layout in RUNS if layout not in FOUR_PROCESSES]), (4, FOUR_PROCESSES)):
        (root / f"runs_{processes}.txt").write_text("\n".join(f"{name} {layout}" for layout in layouts
                                                              for name in RUNS[layout]))
        torchrun([str(WORKER), str(root), f"runs_{processes}.txt"], processes=processes, timeout=1200)  # a hang guard
    return root


def outputs(engine, params, prompts):
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in engine.generate(prompts, params)]


def assert_same(got, expected, tolerance=1e-5):
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in expected]
    assert [finish for _, _, finish in got] == [finish for _, _, finish in expected]
    for (_, logprobs, _), (_, reference, _) in zip(got, expected):
        assert logprobs == pytest.approx(reference, abs=tolerance)


def hf_side(case: Path):
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32).eval()
    prompts = torch.load(case.parent / "prompts.pt")
    return model, tokenizer, prompts


def results(case: Path, layout: str, ranks: int = 2) -> list[dict]:
    loaded = [torch.load(case / f"rollout_{layout}_rank{rank}.pt") for rank in range(ranks)]
    if "refused" in loaded[0]:
        pytest.skip(f"the Megatron backend does not build {case.name}: {loaded[0]['refused']}")
    return loaded


@pytest.mark.parametrize("name, layout", GENERATION)
def test_sharded_generation_equals_the_hf_models(cases, name, layout):
    shards = results(cases / name, layout)
    model, tokenizer, prompts = hf_side(cases / name)
    greedy = outputs(HFGenerationEngine(model, tokenizer, HFEngineConfig()), GREEDY, prompts)
    sampled = outputs(RolloutEngine(model, tokenizer, RolloutEngineConfig()), SAMPLED, prompts)
    assert len({tuple(tokens) for tokens, _, _ in greedy}) > 2  # the prompts lead somewhere different
    for result in shards:
        assert_same(result["greedy"], greedy)
        assert_same(result["sampled"], sampled)
        assert result["kv_heads"] == model.config.num_key_value_heads // int(layout[2])


@pytest.mark.parametrize("layout, ranks", [("tp2_split", 4), ("tp1_pp2_split", 2)])
@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_the_rank_split_shares_requests_over_data_parallel_and_pipeline_ranks(cases, name, layout, ranks):
    """TP2 x DP2: two shares, each decoded by a TP pair; PP=2: each pipeline rank decodes one share."""
    shards = results(cases / name, layout, ranks)
    model, tokenizer, prompts = hf_side(cases / name)
    engine = RolloutEngine(model, tokenizer, RolloutEngineConfig())
    expected = []
    for share_rank in range(2):
        mine = share(len(prompts), share_rank, 2)
        params = replace(SAMPLED, seed=rank_seed(SAMPLED, share_rank, 2))
        expected += outputs(engine, params, prompts[mine.start : mine.stop])
    for result in shards:
        assert_same(result["sampled"], expected)


def scaled(model):
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.01)
    return model


@pytest.mark.parametrize("name", [*LAYOUT_CASES, *MOE_CASES])
def test_pipeline_stages_gathered_in_memory_generate_as_the_hf_model(cases, name):
    shards = results(cases / name, "tp1_pp2")
    model, tokenizer, prompts = hf_side(cases / name)
    greedy = outputs(HFGenerationEngine(model, tokenizer, HFEngineConfig()), GREEDY, prompts)
    sampled = outputs(RolloutEngine(model, tokenizer, RolloutEngineConfig()), SAMPLED, prompts)
    after_step = outputs(HFGenerationEngine(scaled(model), tokenizer, HFEngineConfig()), GREEDY, prompts)
    moved = max(abs(a - b) for (_, new, _), (_, old, _) in zip(after_step, greedy) for a, b in zip(new, old))
    assert moved > 1e-3  # the scaled model's log-probs differ from the unscaled ones
    for result in shards:
        assert_same(result["greedy"], greedy)
        assert_same(result["sampled"], sampled)
        assert_same(result["greedy_scaled"], after_step)


@pytest.mark.parametrize("layout", ["tp2_sp", "tp1", "tp1_pp2"])
@pytest.mark.parametrize("name", MOE_CASES)
def test_a_mixture_of_experts_records_the_experts_the_hf_models_engine_records(cases, name, layout):
    """The experts each token took (`return_routing`), per layer, as the rollout engine on the HF model
    records them; this stage's stacked experts are copies (refreshed before each call), the other
    stage's views of the pipeline gather's buffer (no copy)."""
    shards = results(cases / name, layout)
    model, tokenizer, prompts = hf_side(cases / name)
    expected = [o.routing for o in RolloutEngine(model, tokenizer, RolloutEngineConfig()).generate(prompts, ROUTED)]
    pp = 2 if "pp2" in layout else 1
    for result in shards:
        assert all(torch.equal(got, want) for got, want in zip(result["routing"], expected, strict=True))
        assert result["expert_copies"] == 2 * model.config.num_hidden_layers // pp  # fc1 and fc2 of its own layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalize_top_k", [True, False], ids=["renormalised", "pre_softmax"])
def test_the_engine_routes_as_megatron_cores_router(normalize_top_k, dtype):
    """`route` (transformers' routers, op for op) picks the experts megatron-core's router picks in
    training, with the same weights: its logits in the model's dtype, softmax over all experts then the
    top k (`moe_router_pre_softmax`, no renormalisation: Qwen2-MoE), or the top k of the logits then a
    softmax over them (renormalised: Qwen3-MoE; `model.moe_options`)."""
    import aligner_ext.models.megatron.model  # noqa: F401  (megatron-core's router linear without TE)
    from megatron.core.transformer.moe.moe_utils import router_gating_linear, topk_routing_with_score_function

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator, dtype=dtype)
    router = torch.randn(8, 32, generator=generator, dtype=dtype)
    weights, chosen = route(x, router, 2, normalize_top_k)
    probs, routing_map = topk_routing_with_score_function(router_gating_linear(x, router, None, dtype), 2,
                                                          use_pre_softmax=not normalize_top_k)
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, chosen, True), routing_map)
    torch.testing.assert_close(torch.zeros_like(probs).scatter(1, chosen, weights), probs)


def transformers_experts(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[fed tokens, layers, k]: the experts transformers' routers pick, in increasing order, for each
    token a request fed through the model (its prompt and every generated token but the last)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k).indices.sort().values for logits in out.router_logits], dim=1)


@pytest.mark.parametrize("layout, ranks", [("tp1_ep2", 2), ("tp2_ep2_sp", 4), ("tp1_pp2_ep2", 4)])
@pytest.mark.parametrize("name", MOE_CASES)
def test_expert_parallel_ranks_decode_their_own_prompts_as_the_hf_model(cases, name, layout, ranks):
    """EP=2: each rank holds half the experts and decodes its own prompts, for its own lengths, while
    the other decodes others or none (rollout_worker.py's `EP_SHARES`), as transformers does them
    all; it records transformers' routers' experts for its own tokens."""
    shards = results(cases / name, layout, ranks)
    model, tokenizer, prompts = hf_side(cases / name)
    hf = HFGenerationEngine(model, tokenizer, HFEngineConfig())
    own = {rank: (prompts[start:end], replace(GREEDY, max_new_tokens=new_tokens))
           for rank, (start, end, new_tokens) in EP_SHARES.items()}
    expected = {rank: outputs(hf, params, mine) for rank, (mine, params) in own.items()}
    experts = {rank: [transformers_experts(model, prompt, tokens)
                      for prompt, (tokens, _, _) in zip(mine, expected[rank])] for rank, (mine, _) in own.items()}
    alone = {0: outputs(hf, GREEDY, prompts[:2]), 1: []}
    engine, split_ranks = RolloutEngine(model, tokenizer, RolloutEngineConfig()), shards[0]["split_ranks"]
    split = []
    for share_rank in range(split_ranks):
        mine = share(5, share_rank, split_ranks)
        split += outputs(engine, replace(SAMPLED, seed=rank_seed(SAMPLED, share_rank, split_ranks)),
                         prompts[mine.start : mine.stop])
    scaled_hf = HFGenerationEngine(scaled(model), tokenizer, HFEngineConfig())
    after_step = {rank: outputs(scaled_hf, params, mine) for rank, (mine, params) in own.items()}
    assert [len(tokens) for tokens, _, _ in expected[0]] != [len(tokens) for tokens, _, _ in expected[1]]
    for result in shards:
        rank = result["ep_rank"]
        assert_same(result["own"], expected[rank])
        assert_same(result["alone"], alone[rank])
        assert_same(result["split"], split)
        assert_same(result["own_scaled"], after_step[rank])
        for routing, chosen in zip(result["routing"], experts[rank], strict=True):
            assert torch.equal(routing[:-1].sort(dim=-1).values.long(), chosen)
        assert result["expert_copies"] == 2 * model.config.num_hidden_layers // (2 if "pp2" in layout else 1)
