"""The rollout engine on the Megatron GPTModel's own shards (models/megatron/decoder.py), on CPU under
torchrun (gloo), against the HF model the shards were cut from.

- TP=2 (2 processes) and TP=1 (2 processes, DP=2), Llama (tied embeddings), Qwen2 (q/k/v biases),
  Qwen3 (q/k norms): float32 greedy tokens and finishes identical to the HF engine's on ragged
  prompts, with 3 slots for 6 requests (continuous batching), log-probs within 1e-5 (float32 sums
  in another order); sampled tokens identical to the rollout engine's on the HF model with the same
  seed; both ranks return the same outputs; each TP rank caches only its own K/V heads.
- TP=2 x DP=2 (4 processes) with the trainer's rank split over the data-parallel group: the two
  ranks of a TP pair decode the same share with the same seed, so every rank returns, in order,
  what the HF model's rollout engine samples for each share with that share's seed.
- PP=2 (2 processes): each rank holds one stage and gathers the other's weights in memory
  (`PipelineGather`): the same greedy and sampled outputs as the HF model; after every parameter is
  scaled by 1.01 and `refresh` runs, the greedy outputs and log-probs of the equally scaled HF
  model (stale copies of the other stage would give the old log-probs); with the rank split the
  two pipeline ranks decode one share each.
- TP=2 with the Triton decode attention (the default on a GPU; Triton's interpreter here): the same
  outputs as the HF model's engines.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.distributed import share  # noqa: E402
from aligner_ext.generation.base import SamplingParams  # noqa: E402
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine  # noqa: E402
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig  # noqa: E402
from aligner_ext.generation.sharded import rank_seed  # noqa: E402
from aligner_ext.models.tiny import build_char_tokenizer  # noqa: E402
from megatron_cases import build_model, hf_configs, torchrun  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("rollout_worker.py")
TEXTS = ["hello there", "a", "what is 2+2?", "xyzxyzxyzxyz", "hello there", "Q: name a colour."]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, return_logprobs=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, return_logprobs=True)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_rollout")
    tokenizer = build_char_tokenizer()
    torch.save([tokenizer.encode(text) for text in TEXTS], root / "prompts.pt")
    for name, config in hf_configs().items():
        config.eos_token_id = tokenizer.eos_token_id
        build_model(config).save_pretrained(root / name)
    torchrun([str(WORKER), str(root), "2", "1"], timeout=240)
    torchrun([str(WORKER), str(root), "2", "1", "triton"], timeout=240)
    torchrun([str(WORKER), str(root), "1", "1"], timeout=240)
    torchrun([str(WORKER), str(root), "2", "1", "split"], processes=4, timeout=300)
    torchrun([str(WORKER), str(root), "1", "2"], timeout=240)
    torchrun([str(WORKER), str(root), "1", "2", "split"], timeout=240)
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


@pytest.mark.parametrize("name", sorted(hf_configs()))
@pytest.mark.parametrize("tp", [2, 1, "2_triton"])
def test_sharded_generation_equals_the_hf_models(cases, name, tp):
    model, tokenizer, prompts = hf_side(cases / name)
    greedy = outputs(HFGenerationEngine(model, tokenizer, HFEngineConfig()), GREEDY, prompts)
    sampled = outputs(RolloutEngine(model, tokenizer, RolloutEngineConfig()), SAMPLED, prompts)
    assert len({tuple(tokens) for tokens, _, _ in greedy}) > 1  # the prompts lead somewhere different
    for rank in range(2):
        result = torch.load(cases / name / f"rollout_tp{tp}_rank{rank}.pt")
        assert_same(result["greedy"], greedy)
        assert_same(result["sampled"], sampled)
        assert result["kv_heads"] == model.config.num_key_value_heads // int(str(tp)[0])


@pytest.mark.parametrize("layout, ranks", [("tp2_split", 4), ("tp1_pp2_split", 2)])
@pytest.mark.parametrize("name", sorted(hf_configs()))
def test_the_rank_split_shares_requests_over_data_parallel_and_pipeline_ranks(cases, name, layout, ranks):
    """TP2 x DP2: two shares, each decoded by a TP pair; PP=2: each pipeline rank decodes one share."""
    model, tokenizer, prompts = hf_side(cases / name)
    engine = RolloutEngine(model, tokenizer, RolloutEngineConfig())
    expected = []
    for share_rank in range(2):
        mine = share(len(prompts), share_rank, 2)
        params = replace(SAMPLED, seed=rank_seed(SAMPLED, share_rank, 2))
        expected += outputs(engine, params, prompts[mine.start : mine.stop])
    for rank in range(ranks):
        assert_same(torch.load(cases / name / f"rollout_{layout}_rank{rank}.pt")["sampled"], expected)


def scaled(model):
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.01)
    return model


@pytest.mark.parametrize("name", sorted(hf_configs()))
def test_pipeline_stages_gathered_in_memory_generate_as_the_hf_model(cases, name):
    model, tokenizer, prompts = hf_side(cases / name)
    greedy = outputs(HFGenerationEngine(model, tokenizer, HFEngineConfig()), GREEDY, prompts)
    sampled = outputs(RolloutEngine(model, tokenizer, RolloutEngineConfig()), SAMPLED, prompts)
    after_step = outputs(HFGenerationEngine(scaled(model), tokenizer, HFEngineConfig()), GREEDY, prompts)
    moved = max(abs(a - b) for (_, new, _), (_, old, _) in zip(after_step, greedy) for a, b in zip(new, old))
    assert moved > 1e-3  # the scaled model's log-probs differ from the unscaled ones
    for rank in range(2):
        result = torch.load(cases / name / f"rollout_tp1_pp2_rank{rank}.pt")
        assert_same(result["greedy"], greedy)
        assert_same(result["sampled"], sampled)
        assert_same(result["greedy_scaled"], after_step)

