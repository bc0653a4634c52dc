"""Groups carried over between steps (experience/carry_over.py, `rollout.carry_over`): which groups a batch takes,
the tokens, log-probs and versions of a response sampled over several calls, the draws, waiting for or dropping
an overdue group, the carry through a checkpoint; the rollout engine's side (per-prompt caps, each whole output
reported, a call stopped once enough are); the settings refused at load."""

import copy

import pytest

from aligner_ext.config import load_config
from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import ConfigError
from aligner_ext.experience.base import GroupSampling, SampleRequest
from aligner_ext.experience.carry_over import CarryOver
from aligner_ext.experience.settings import CarryOverConfig, RolloutConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

N = 2  # samples a group
FIRST_TOKEN = 100  # the k-th token of every response is FIRST_TOKEN + k, whichever call sampled it


class LockstepEngine(GenerationEngine):
    """Decodes every request of a call one token a step, all together. A request's generator prompt is [draw,
    sample] followed by its response so far; the response is whole at LENGTHS[draw, sample] tokens ("eos"), or
    cut at its cap ("length"). A token's log-prob encodes its position and the weights' version. Reports each
    whole output and asks `should_stop` before each step, as the rollout engine does."""

    reports_finished = True

    def __init__(self, lengths: dict[tuple[int, int], int]):
        self.lengths, self.calls = lengths, []

    def generate(self, prompts, params, should_stop=None, caps=None, on_finished=None):
        self.calls.append([tuple(prompt[:2]) for prompt in prompts])
        tokens = [[] for _ in prompts]
        reasons = [None] * len(prompts)
        while None in reasons and not (should_stop and should_stop()):
            for index, prompt in enumerate(prompts):
                if reasons[index] is None:
                    tokens[index].append(FIRST_TOKEN + len(prompt) - 2 + len(tokens[index]))
                    if len(prompt) - 2 + len(tokens[index]) == self.lengths[tuple(prompt[:2])]:
                        reasons[index] = "eos"
                    elif len(tokens[index]) == caps[index]:
                        reasons[index] = "length"
                    if reasons[index] is not None:
                        on_finished(index)
        return [GenerationOutput(token_ids=ids, finish_reason=reason or "length",
                                 logprobs=[logprob(token, self.weights_version) for token in ids])
                for ids, reason in zip(tokens, reasons)]


def logprob(token: int, version: int) -> float:
    return -(token - FIRST_TOKEN + 1) / 100 - version


def requests_of(draws):
    """n requests a draw, each its own generator prompt [draw, sample] (the engine's key to its length)."""
    return [SampleRequest(draw, [draw.draw_id, sample], draw.draw_id) for draw in draws for sample in range(N)]


def prompt_stream(tokenizer) -> PromptLoader:
    rows = [PromptRow(f"r{i}", [{"role": "user", "content": f"{i}"}], "arithmetic", "0") for i in range(12)]
    return PromptLoader(rows, tokenizer, DataConfig(), batch_size=2, shuffle=False)


@pytest.fixture
def loader(tiny_tokenizer):
    return prompt_stream(tiny_tokenizer)


# draw 1's first sample is the long tail: 8 tokens, where the others take 1-4
LENGTHS = {(0, 0): 2, (0, 1): 2, (1, 0): 8, (1, 1): 2, (2, 0): 3, (2, 1): 1, (3, 0): 2, (3, 1): 2,
           (4, 0): 4, (4, 1): 4, (5, 0): 1, (5, 1): 1, (6, 0): 1, (6, 1): 1, (7, 0): 1, (7, 1): 1, (8, 0): 1,
           (8, 1): 1}
PARAMS = SamplingParams(max_new_tokens=16, return_logprobs=True)


def step(carry: CarryOver, loader, engine, version):
    """One step's (group of each sample, responses, versions, log-probs, finish reasons), and its metrics."""
    engine.weights_version = version
    requests, outputs, metrics = carry.generate(loader, PARAMS, requests_of)
    return ([request.group_id for request in requests], [output.token_ids for output in outputs],
            [output.versions for output in outputs], [output.logprobs for output in outputs],
            [output.finish_reason for output in outputs]), metrics


def test_a_batch_takes_the_first_whole_groups_and_the_long_tail_goes_on_in_later_calls(tiny_tokenizer, loader):
    engine = LockstepEngine(LENGTHS)
    carry = CarryOver(CarryOverConfig(groups=1, max_steps=2), engine=engine, tokenizer=tiny_tokenizer)

    # step 0 runs draws 0-2 and ends at its third decode step, when groups 0 and 2 are whole; draw 1 has 3 of 8 tokens
    (groups, responses, versions, _, _), metrics = step(carry, loader, engine, version=0)
    assert engine.calls[0] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert groups == [0, 0, 2, 2]
    assert responses == [[100, 101], [100, 101], [100, 101, 102], [100]]
    assert metrics == {"carry_over/carried_groups": 1, "carry_over/dropped_groups": 0,
                       "carry_over/batch_share_carried": 0.0}
    assert loader.position == 3  # B + groups drawn

    # step 1: the carried response first, then two new draws (B of them); group 1 is not overdue yet (carried
    # once, max_steps 2), so the call ends with groups 3 and 4, at its fourth step
    (groups, responses, versions, _, _), metrics = step(carry, loader, engine, version=1)
    assert engine.calls[1] == [(1, 0), (3, 0), (3, 1), (4, 0), (4, 1)]
    assert groups == [3, 3, 4, 4] and versions == [[1, 1], [1, 1], [1] * 4, [1] * 4]
    assert metrics["carry_over/carried_groups"] == 1 and loader.position == 5

    # step 2: group 1 is overdue (carried twice): the call waits for it, and the batch takes it first
    (groups, responses, versions, logprobs, reasons), metrics = step(carry, loader, engine, version=2)
    assert groups == [1, 1, 5, 5]
    assert responses[0] == list(range(100, 108)) and responses[1] == [100, 101]
    assert versions[0] == [0, 0, 0, 1, 1, 1, 1, 2] and versions[1] == [0, 0]  # each token the weights that sampled it
    assert logprobs[0] == [logprob(token, version) for token, version in zip(responses[0], versions[0])]
    assert reasons[:2] == ["eos", "eos"]
    assert metrics == {"carry_over/carried_groups": 1, "carry_over/dropped_groups": 0,
                       "carry_over/batch_share_carried": 0.5}

    # step 3: group 6, whole in step 2 beyond the batch, leads it; two new draws (the carry held one group)
    (groups, _, versions, _, _), _ = step(carry, loader, engine, version=3)
    assert groups == [6, 6, 7, 7] and versions[0] == [2] and versions[2] == [3]
    assert loader.position == 9


def test_an_overdue_group_is_dropped_and_counted_where_configured(tiny_tokenizer, loader):
    engine = LockstepEngine({**LENGTHS, (1, 0): 16})  # draw 1 would take every step's call to the end
    carry = CarryOver(CarryOverConfig(groups=1, max_steps=1, overdue="drop"), engine=engine,
                      tokenizer=tiny_tokenizer)
    step(carry, loader, engine, version=0)
    (groups, _, _, _, _), metrics = step(carry, loader, engine, version=1)  # group 1 overdue: not waited for
    assert groups == [3, 3, 4, 4]
    assert metrics["carry_over/dropped_groups"] == 1 and metrics["carry_over/carried_groups"] == 0
    step(carry, loader, engine, version=2)
    assert engine.calls[2] == [(draw, sample) for draw in (5, 6, 7) for sample in range(N)]  # three new draws

    waiting = CarryOver(CarryOverConfig(groups=1, max_steps=1), engine=engine, tokenizer=tiny_tokenizer)
    loader = prompt_stream(tiny_tokenizer)
    step(waiting, loader, engine, version=0)
    (groups, responses, _, _, _), metrics = step(waiting, loader, engine, version=1)  # overdue: the call waits for it
    assert groups[:2] == [1, 1] and len(responses[0]) == 16 and metrics["carry_over/dropped_groups"] == 0


def test_a_resume_from_the_carry_in_a_checkpoint_makes_the_same_batches(tiny_tokenizer, loader):
    def carry_over():
        return CarryOver(CarryOverConfig(groups=1, max_steps=2), engine=engine, tokenizer=tiny_tokenizer)

    engine = LockstepEngine(LENGTHS)
    uninterrupted = carry_over()
    step(uninterrupted, loader, engine, version=0)
    saved = copy.deepcopy((uninterrupted.state_dict(), loader.state_dict()))
    expected = [step(uninterrupted, loader, engine, version) for version in (1, 2, 3)]

    resumed = carry_over()
    resumed.load_state_dict(saved[0])
    loader.load_state_dict(saved[1])
    assert [step(resumed, loader, engine, version) for version in (1, 2, 3)] == expected


def test_a_resume_switching_carry_over_on_starts_empty_and_off_drops_the_carry_in_one_line(tiny_tokenizer, caplog):
    engine = LockstepEngine(LENGTHS)
    carrying = GroupSampling(RolloutConfig(n=N, carry_over=CarryOverConfig(groups=1)), engine, None, tiny_tokenizer)
    carrying.load_state_dict({})  # saved by a run that carried nothing
    assert carrying.carry_over.groups == []
    plain = GroupSampling(RolloutConfig(n=N), engine, None, tiny_tokenizer)
    caplog.set_level("WARNING", logger="aligner_ext.experience.base")
    plain.load_state_dict({"carried": [object(), object()]})
    assert [record.getMessage() for record in caplog.records] == [
        "dropping the checkpoint's 2 group(s) carried over to the next step: this run has rollout.carry_over.groups=0, "
        "so their prompts are not trained"]


def test_the_rollout_engine_caps_each_prompt_reports_whole_outputs_and_stops_when_asked(tiny_tokenizer):
    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=1)
    engine = RolloutEngine(build_tiny_model(tiny_tokenizer, shape).eval(), tiny_tokenizer,
                           RolloutEngineConfig(max_batch_size=2))
    prompts = [tiny_tokenizer.encode(text) for text in ("1+2=", "3+4=", "5+6=")]
    params = SamplingParams(max_new_tokens=10, seed=5, ignore_eos=True, return_logprobs=True)
    uncapped = engine.generate(prompts, params)
    finished = []
    capped = engine.generate(prompts, params, caps=[3, 10, 4], on_finished=finished.append)
    assert [output.token_ids for output in capped] == [uncapped[0].token_ids[:3], uncapped[1].token_ids,
                                                       uncapped[2].token_ids[:4]]
    assert [output.finish_reason for output in capped] == ["length"] * 3
    assert finished == [0, 2, 1]  # as each became whole; prompt 2 waited for prompt 0's slot, then took 4 tokens

    finished = []
    stopped = engine.generate(prompts, params, caps=[3, 10, 10], on_finished=finished.append,
                              should_stop=lambda: bool(finished))
    assert finished == [0]  # the others were cut where they stood, not reported whole
    assert stopped[0].token_ids == uncapped[0].token_ids[:3]
    cut = len(stopped[1].token_ids)
    assert 3 <= cut < 10 and stopped[1].token_ids == uncapped[1].token_ids[:cut] and stopped[2].token_ids == []
    with pytest.raises(ValueError, match=r"caps: one per prompt, each in \[1, max_new_tokens=10\]"):
        engine.generate(prompts, params, caps=[3, 11, 1])


def test_group_sampling_refuses_an_engine_that_does_not_report_finished_responses(tiny_tokenizer):
    class OneShot(GenerationEngine):
        def generate(self, prompts, params):
            raise AssertionError("never called")

    with pytest.raises(ConfigError, match=r"^rollout\.carry_over\.groups=1 needs the rollout engine in one process.*"
                                          r"generates with OneShot"):
        GroupSampling(RolloutConfig(carry_over=CarryOverConfig(groups=1)), OneShot(), None, tiny_tokenizer)


REFUSED = {
    "above the batch": (["data.train_batch_size=2", "rollout.carry_over.groups=3"], "is above data.train_batch_size=2"),
    "another maker": (["+variant=mtpo", "rollout.carry_over.groups=1"],
                      "with algorithm.experience_maker=two_round: groups are carried over by group sampling and the "
                      "graded system prompt only"),
    "dynamic sampling's surplus": (["+variant=dapo", "rollout.carry_over.groups=1", "dynamic_sampling.keep_surplus=true"],
                                   "with dynamic_sampling.keep_surplus=true"),
    "the hf engine": (["generator.engine=hf", "rollout.carry_over.groups=1"],
                      "with generator.engine=hf: carrying groups over needs the rollout engine"),
}


def test_the_graded_prompt_carries_groups_over():
    cfg = load_config("base", ["+variant=graded_prompt", "generator.engine=rollout", "rollout.carry_over.groups=1"])
    assert cfg.rollout.carry_over.groups == 1


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_at_load_naming_both(case):
    overrides, message = REFUSED[case]
    with pytest.raises(ValueError, match=r"^rollout\.carry_over\.groups=\d .*" + message.replace("(", r"\(")):
        load_config("base", overrides)


class AgreeingFirstRow:
    """Rewards in which row r0's samples all agree (its group is filtered out) and every other group's are mixed."""

    def score(self, responses, rows):
        from aligner_ext.rewards.base import RewardResult

        return [RewardResult(score=value, correct=value)
                for value in (0.0 if row.row_id == "r0" else float(index % 2) for index, row in enumerate(rows))]

    def metrics(self):
        return {}


def test_a_dynamic_sampling_refill_asks_only_for_the_missing_groups_and_carries_the_rest(tiny_tokenizer, loader):
    """Dynamic sampling over carried groups: a refill's call takes the groups it asks for (B is the loader's batch at
    each call), and the groups it began go on in the next call, as between steps."""
    from aligner_ext.experience.dynamic_sampling import DynamicSampling
    from aligner_ext.experience.settings import DynamicSamplingConfig

    engine = LockstepEngine(LENGTHS)
    sampling = GroupSampling(RolloutConfig(n=N, max_response_length=16, carry_over=CarryOverConfig(groups=1, max_steps=3)),
                             engine, AgreeingFirstRow(), tiny_tokenizer)
    sampling.requests = requests_of
    maker = DynamicSampling(sampling, DynamicSamplingConfig(enabled=True, max_gen_batches=0), tiny_tokenizer.pad_token_id)
    batch, metrics = maker.make_experience(loader, 0)
    # the first call ends once groups 0 and 2 are whole; group 0 agrees and is dropped, so one group is missing:
    # the refill draws one prompt (3) beside the carried group 1 and ends once one group (3) is whole
    assert engine.calls == [[(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], [(1, 0), (3, 0), (3, 1)]]
    assert batch.group_ids.tolist() == [2, 2, 3, 3] and loader.position == 4
    assert metrics["dynamic_sampling/num_gen_batches"] == 2 and metrics["dynamic_sampling/generated_groups"] == 3
    assert [group.requests[0].group_id for group in sampling.carry_over.groups] == [1]  # 5 of its 8 tokens so far
    assert len(sampling.carry_over.groups[0].responses[0].token_ids) == 5
