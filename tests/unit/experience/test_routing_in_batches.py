"""The rollout engine's expert choices in the experience makers' batches (`prompt_routing`,
`response_routing`): token for token beside the ids, so that `batch.routing` at every recorded real
token is the top k transformers' routers take in a padded forward of the batch (prompts left-padded,
responses right-padded, the trainer's layout), in float64 on a tiny Qwen3-MoE; NOT_RECORDED on pads and
each row's last token. MTPO joins round 1's routing of the prompt and answer to round 2's of the rest;
an agent episode's row carries, over its prompt, sampled turns and observations, what its turns fed
through the engine (kept-cache continuations, recomputations after evictions, shared first prompts);
rows generated from another prompt than the trained one (the graded system prompt) and the hinted
sequences of CPO's pass, which no engine ran, carry none."""

import pytest
import torch

from aligner_ext.agents.environment import Environment, Episode, StepResult, register_environment
from aligner_ext.agents.settings import AgentsConfig, EpisodeLimits
from aligner_ext.batch import ExperienceBatch
from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.experience.agent_episodes import AgentEpisodes
from aligner_ext.experience.base import GroupSampling, RolloutConfig, SampleRequest
from aligner_ext.experience.hint_logprobs import hinted_batch
from aligner_ext.experience.two_round import TwoRoundSample, TwoRoundSampling, _joined
from aligner_ext.generation.base import NOT_RECORDED, GenerationOutput, SamplingParams
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.family_configs import (
    decisive_experts,
    family_config,
    random_model,
)
from aligner_ext.rewards.manager import RewardConfig, RewardManager

LAYERS, TOP_K = 2, 2


@pytest.fixture
def rewards():
    manager = RewardManager(RewardConfig(num_workers=1))
    yield manager
    manager.close()


@pytest.fixture
def moe_model(tiny_tokenizer):
    """Qwen3-MoE in float64, routers drawn large (no near ties), experts so that they decide the outputs."""
    config = family_config("qwen3_moe", hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                           num_experts=8, num_experts_per_tok=TOP_K, max_position_embeddings=256,
                           vocab_size=len(tiny_tokenizer), eos_token_id=tiny_tokenizer.eos_token_id,
                           pad_token_id=tiny_tokenizer.pad_token_id)
    model = random_model(config)
    decisive_experts(model, 0.2)
    model = model.double()
    model.set_experts_implementation("eager")
    return model


def padded_forward_experts(model, batch: ExperienceBatch) -> torch.Tensor:
    """[B, P+R, layers, k] transformers' top k in one forward of the padded batch."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda router, args, output: chosen.append(output[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1).view(*batch.input_ids.shape, LAYERS, TOP_K)


def check_batch_routing(model, batch: ExperienceBatch) -> None:
    mask = batch.attention_mask.bool()
    last = mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)
    recorded = mask & ~(last & mask)
    routing = batch.routing
    assert routing.shape == (*mask.shape, LAYERS, TOP_K) and routing.dtype == torch.int16
    assert torch.equal(routing[recorded].long(), padded_forward_experts(model, batch)[recorded])
    assert (routing[~recorded] == NOT_RECORDED).all()


def question(index: int, text: str) -> PromptRow:
    return PromptRow(row_id=f"t:{index}", messages=[{"role": "user", "content": text}], data_source="short_qa",
                     ground_truth="red")


def test_group_sampling_lays_the_engines_routing_out_as_the_batch_lays_its_tokens(tiny_tokenizer, moe_model, rewards):
    rows = [question(0, "Which colour is the sky?"), question(1, "Name a fruit, please.")]
    loader = PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=2, shuffle=False)
    engine = RolloutEngine(moe_model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=4))
    maker = GroupSampling(RolloutConfig(n=3, max_response_length=7, stop=["e"]), engine, rewards, tiny_tokenizer,
                          return_routing=True)
    batch, _ = maker.make_experience(loader, step=0)
    assert len(set(batch.response_lengths.tolist())) > 1 and len(set(batch.prompt_mask.sum(1).tolist())) > 1
    check_batch_routing(moe_model, batch)

    plain = GroupSampling(RolloutConfig(n=3, max_response_length=7), engine, rewards, tiny_tokenizer)
    assert plain.make_experience(loader, step=0)[0].prompt_routing is None  # not asked: nothing recorded


def test_mtpo_samples_carry_round_one_then_round_two_routing(tiny_tokenizer, moe_model, rewards):
    """Round 2 continues the closed answers from the kept cache; each sample's routing over prompt, answer
    and confidence is transformers' top k of the joined sequence."""
    engine = RolloutEngine(moe_model, tiny_tokenizer, RolloutEngineConfig())
    rows = [question(0, "Which colour is the sky at noon?"), question(1, "Name a fruit.")]
    draws = PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=2, shuffle=False).next_batch()

    def two_rounds(answer_stop: str):
        maker = TwoRoundSampling(TwoRoundSampling.Config(num_answer_generations=2, num_confidence_generations=2,
                                                         max_answer_length=12, max_confidence_length=6,
                                                         answer_stop_str=answer_stop),
                                 RolloutConfig(n=4), engine, rewards, tiny_tokenizer, seed=3, return_routing=True)
        return maker, maker.two_rounds(draws, 2, 2, *maker.round_params(step=0))[0]

    # a stop string round 1 meets: a character from the middle of an answer sampled without one
    _, unstopped = two_rounds("<never>")
    maker, samples = two_rounds(tiny_tokenizer.decode(unstopped[0].answer.token_ids[6:7]))
    assert any(s.confidence is not None for s in samples) and any(s.confidence is None for s in samples)
    assert engine.last_call["prefix_reused_tokens"] > 0
    requests = [SampleRequest(s.draw, s.draw.prompt_ids, s.draw.draw_id) for s in samples]
    check_batch_routing(moe_model, maker.assemble(requests, [_joined(s) for s in samples]))


def test_joined_routing_takes_round_one_up_to_the_answers_last_token():
    """Prompt 2 tokens, answer 3, confidence 2: round 1 fed 4 tokens, round 2 fed 6 (its prompt is 5)."""
    answer = GenerationOutput([7, 8, 9], "stop", routing=torch.tensor([1, 1, 1, 1, NOT_RECORDED])[:, None, None])
    confidence = GenerationOutput([5, 6], "stop", routing=torch.tensor([2] * 6 + [NOT_RECORDED])[:, None, None])
    joined = _joined(TwoRoundSample(draw=None, answer_id=0, copy=0, answer=answer, confidence=confidence))
    assert joined.routing.flatten().tolist() == [1, 1, 1, 1, 2, 2, NOT_RECORDED]
    unclosed = _joined(TwoRoundSample(draw=None, answer_id=0, copy=0, answer=answer, confidence=None))
    assert unclosed.routing is answer.routing


@register_environment("test_routing_feedback")
class Feedback(Environment):
    """Answers every turn with the same feedback; the episode runs to max_turns, scored 0."""

    async def reset(self, row):
        return Episode(list(row.messages))

    async def step(self, message, state):
        return StepResult([{"role": "user", "content": "no, again"}])

    async def score(self, state):
        return 0.0


@pytest.mark.parametrize("turns", ["session", "one_call_per_turn"])
def test_agent_episodes_rows_carry_the_routing_their_turns_fed_through_the_engine(tiny_tokenizer, moe_model,
                                                                                 rewards, monkeypatch, turns):
    """Three slots for four episodes of three turns: a group's first prompt prefilled once, later turns
    prefilling only their new ids on the kept cache, turns recomputed after their slot was evicted; or,
    without the engine's turn sessions, one generate call per turn (prefixes from its kept cache)."""
    engine = RolloutEngine(moe_model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=3))
    if turns == "one_call_per_turn":
        monkeypatch.setattr(engine, "open_session", lambda *args: None)
    cfg = AgentsConfig(environment="test_routing_feedback", limits=EpisodeLimits(max_turns=3, max_total_tokens=200))
    maker = AgentEpisodes(cfg, RolloutConfig(n=2, max_response_length=12), engine, rewards, tiny_tokenizer, seed=5,
                          return_routing=True)
    draws = [PromptDraw(question(i, text), [], i) for i, text in enumerate(["Name a fruit.", "Which colour?"])]
    outcomes, session = maker.runner.run(draws, 2, maker.sampling_params(step=0))
    assert all(outcome.counts["turns"] == 3 and outcome.counts["observation_tokens"] for outcome in outcomes)
    if turns == "session":
        assert session["reused_tokens"] and session["recomputed_tokens"] and session["evictions"]
    check_batch_routing(moe_model, maker.assemble_episodes(outcomes))


def test_a_row_generated_from_another_prompt_carries_no_routing(tiny_tokenizer, moe_model, rewards):
    """The graded system prompt's rows: the engine saw a system message the trained prompt lacks."""
    loader = PromptLoader([question(0, "Name a fruit.")], tiny_tokenizer, DataConfig(), batch_size=1, shuffle=False)
    [draw] = loader.next_batch()
    other = tiny_tokenizer.encode("Be brief.") + draw.prompt_ids
    engine = RolloutEngine(moe_model, tiny_tokenizer, RolloutEngineConfig())
    requests = [SampleRequest(draw, draw.prompt_ids, 0), SampleRequest(draw, other, 0)]
    outputs = engine.generate([r.generation_prompt for r in requests],
                              SamplingParams(max_new_tokens=4, seed=1, return_routing=True))
    maker = GroupSampling(RolloutConfig(n=2), engine, rewards, tiny_tokenizer)
    batch = maker.assemble(requests, outputs)
    assert (batch.routing[1] == NOT_RECORDED).all()
    check_batch_routing(moe_model, batch.select([0]))
    only_other = maker.assemble(requests[1:], outputs[1:])  # still set: batches stack with others
    assert only_other.routing.shape[2:] == (LAYERS, TOP_K) and (only_other.routing == NOT_RECORDED).all()


def test_cpos_hinted_sequences_drop_the_routing(tiny_tokenizer, moe_model, rewards):
    loader = PromptLoader([question(0, "Name a fruit.")], tiny_tokenizer, DataConfig(), batch_size=1, shuffle=False)
    engine = RolloutEngine(moe_model, tiny_tokenizer, RolloutEngineConfig())
    maker = GroupSampling(RolloutConfig(n=2, max_response_length=4), engine, rewards, tiny_tokenizer,
                          return_routing=True)
    batch, _ = maker.make_experience(loader, step=0)
    hinted = hinted_batch(batch, [tiny_tokenizer.encode("Hint: a fruit is sweet.")] * 2, tiny_tokenizer.pad_token_id)
    assert batch.routing is not None and hinted.routing is None and hinted.response_routing is None
