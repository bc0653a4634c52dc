"""Turn sessions (generation/turns.py): every turn of a multi-turn episode gives the tokens, finish and
log-probs of a fresh `generate` call on its whole ids, whatever turns share its steps, in whatever
order they come and however few slots there are; a turn that extends what its episode's slot holds
prefills only its new tokens; evictions take the least recently used idle slot and cost a
recomputation; the settings a session does not serve are refused in one line. On a GPU (skipped
elsewhere) the session's CUDA graphs give the eager engine's outputs."""

import dataclasses

import pytest
import torch

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, return_logprobs=True)
OBSERVATION = " -> ok."


@pytest.fixture
def model(tiny_tokenizer):
    shape = TinyModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)
    return build_tiny_model(tiny_tokenizer, shape).eval()


def fresh(model, tokenizer, ids, params, max_new_tokens, seed):
    """The turn as one `generate` call on a fresh engine (no kept cache): the reference."""
    engine = RolloutEngine(model, tokenizer, RolloutEngineConfig(prefix_cache=False))
    return engine.generate([ids], dataclasses.replace(params, max_new_tokens=max_new_tokens, seed=seed))[0]


def assert_same(output, expected):
    assert (output.token_ids, output.finish_reason) == (expected.token_ids, expected.finish_reason)
    if expected.logprobs is None:
        assert output.logprobs is None
    else:
        assert output.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


class Episodes:
    """Scripted episodes: episode e's turn t continues its trajectory by CAPS[e][t] tokens with seed
    100 e + t; a finished turn's trajectory grows by its sampled ids and OBSERVATION's ids, which its
    tool answers TOOL_STEPS[e] session steps later."""

    CAPS = [[6, 9, 4], [3, 7, 5], [8, 2, 6], [5, 5, 5]]
    TOOL_STEPS = [0, 3, 1, 5]
    QUESTIONS = ["What is 12+7?", "Name a colour.", "hello there", "Q: a city?"]

    def __init__(self, tokenizer, count):
        self.observation = tokenizer.encode(OBSERVATION)
        self.ids = {e: tokenizer.encode(self.QUESTIONS[e]) for e in range(count)}
        self.turn = {e: 0 for e in range(count)}
        self.turns = []  # (episode, ids, max_new_tokens, seed, output) in the order they finished
        self.tools: dict[int, int] = {}  # episode -> session steps until its tool answers

    def submit(self, session, episode):
        turn = self.turn[episode]
        session.submit(episode, self.ids[episode], self.CAPS[episode][turn], 100 * episode + turn)

    def finished(self, session, episode, output):
        turn = self.turn[episode]
        self.turns.append((episode, self.ids[episode], self.CAPS[episode][turn], 100 * episode + turn, output))
        self.ids[episode] = self.ids[episode] + output.token_ids + self.observation
        self.turn[episode] += 1
        if self.turn[episode] < len(self.CAPS[episode]):
            self.tools[episode] = self.TOOL_STEPS[episode]
        else:
            session.release(episode)

    def answer_tools(self, session):
        """Submit the next turn of each episode whose tool answered; count down the others."""
        for episode, steps in list(self.tools.items()):
            if steps == 0:
                del self.tools[episode]
                self.submit(session, episode)
            else:
                self.tools[episode] = steps - 1


def run_concurrently(session, episodes, order):
    """Every episode's first turn submitted (in `order`), each next turn when its tool answers."""
    for episode in order:
        episodes.submit(session, episode)
    while session.busy() or episodes.tools:
        for episode, output in session.step():
            episodes.finished(session, episode, output)
        episodes.answer_tools(session)


@pytest.mark.parametrize("order,slots", [([0, 1, 2], 8), ([2, 0, 1], 3)])
def test_concurrent_turns_continue_their_slots_as_fresh_calls_would(tiny_tokenizer, model, order, slots):
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=slots))
    session = engine.open_session(SAMPLED, max_length=96, max_episodes=3)
    episodes = Episodes(tiny_tokenizer, 3)
    run_concurrently(session, episodes, order)

    assert len(episodes.turns) == 9
    for _, ids, cap, seed, output in episodes.turns:
        assert_same(output, fresh(model, tiny_tokenizer, ids, SAMPLED, cap, seed))
    # every episode kept its slot: a first turn prefills its question; a later turn continues the K/V of
    # the previous turn's ids and sampled tokens but the last, and prefills that last token and the observation
    questions = sum(len(tiny_tokenizer.encode(Episodes.QUESTIONS[e])) for e in range(3))
    previous = {}
    reused = 0
    for episode, ids, _, _, output in episodes.turns:
        if episode in previous:
            reused += len(previous[episode][0]) + len(previous[episode][1].token_ids) - 1
        previous[episode] = (ids, output)
    continued_turns = 6
    assert session.stats == {"prefilled_tokens": questions + continued_turns * (len(episodes.observation) + 1),
                             "reused_tokens": reused, "recomputed_tokens": 0, "evictions": 0, "turns": 9,
                             "moves": session.stats["moves"], "decode_steps": session.stats["decode_steps"]}
    session.close()


def test_each_turn_prefills_only_its_new_tokens(tiny_tokenizer, model):
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig())
    session = engine.open_session(SAMPLED, max_length=96, max_episodes=2)
    ids = tiny_tokenizer.encode("What is 12+7?")
    observation = tiny_tokenizer.encode(OBSERVATION)
    held = 0
    for turn, cap in enumerate((7, 4, 9)):
        before = session.stats
        session.submit("a", ids, cap, turn)
        finished = []
        while session.busy():
            finished += session.step()
        assert [key for key, _ in finished] == ["a"]
        output = finished[0][1]
        assert_same(output, fresh(model, tiny_tokenizer, ids, SAMPLED, cap, turn))
        prefilled = session.stats["prefilled_tokens"] - before["prefilled_tokens"]
        assert prefilled == len(ids) - held  # turn 0: the whole question; then the last sampled token + observation
        assert prefilled == (len(ids) if turn == 0 else len(observation) + 1)
        assert session.stats["reused_tokens"] - before["reused_tokens"] == held
        held = len(ids) + len(output.token_ids) - 1
        ids = ids + output.token_ids + observation


def finish_turn(session, key, ids, cap, seed):
    session.submit(key, ids, cap, seed)
    finished = []
    while session.busy():
        finished += session.step()
    assert [k for k, _ in finished] == [key]
    return finished[0][1]


def test_ids_that_do_not_extend_the_slot_are_prefilled_again(tiny_tokenizer, model):
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig()).open_session(SAMPLED, 96, 2)
    ids = tiny_tokenizer.encode("What is 12+7?")
    output = finish_turn(session, "a", ids, 6, 1)
    rewritten = ids[:-1] + [ids[0]] + output.token_ids  # one held token changed: the slot's K/V do not apply
    before = session.stats
    second = finish_turn(session, "a", rewritten, 5, 2)
    assert_same(second, fresh(model, tiny_tokenizer, rewritten, SAMPLED, 5, 2))
    assert session.stats["prefilled_tokens"] - before["prefilled_tokens"] == len(rewritten)
    assert session.stats["recomputed_tokens"] == len(rewritten)
    assert session.stats["reused_tokens"] == before["reused_tokens"]


def test_a_full_session_evicts_the_least_recently_used_idle_slot(tiny_tokenizer, model):
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=2)).open_session(SAMPLED, 96, 3)
    observation = tiny_tokenizer.encode(OBSERVATION)
    ids = {key: tiny_tokenizer.encode(text) for key, text in zip("abc", ("What is 12+7?", "Name a colour.", "hi"))}
    outputs = {key: finish_turn(session, key, ids[key], 5, seed) for seed, key in enumerate("abc")}
    # two slots: c took the slot of a, whose turn finished first
    assert session.stats["evictions"] == 1
    next_ids = {key: ids[key] + outputs[key].token_ids + observation for key in "abc"}
    before = session.stats
    finish_turn(session, "b", next_ids["b"], 4, 10)  # b still holds its slot
    assert session.stats["prefilled_tokens"] - before["prefilled_tokens"] == len(observation) + 1
    assert session.stats["evictions"] == 1
    before = session.stats
    second = finish_turn(session, "a", next_ids["a"], 4, 11)  # a lost its slot: it takes c's (used before b's turn)
    assert_same(second, fresh(model, tiny_tokenizer, next_ids["a"], SAMPLED, 4, 11))
    assert session.stats["prefilled_tokens"] - before["prefilled_tokens"] == len(next_ids["a"])
    assert session.stats["recomputed_tokens"] == len(next_ids["a"])
    assert session.stats["evictions"] == 2


def test_an_episode_above_freed_slots_moves_down_with_its_kv_and_continues_exactly(tiny_tokenizer, model):
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig()).open_session(SAMPLED, 96, 3)
    observation = tiny_tokenizer.encode(OBSERVATION)
    ids = {key: tiny_tokenizer.encode(text) for key, text in zip("abc", ("What is 12+7?", "Name a colour.", "hi"))}
    for seed, key in enumerate("abc"):
        session.submit(key, ids[key], 5, seed)
    finished = []
    while session.busy():
        finished += session.step()
    assert sorted(key for key, _ in finished) == ["a", "b", "c"]
    session.release("a")
    session.release("b")  # slots 0 and 1 free; c holds slot 2
    c_ids = ids["c"] + dict(finished)["c"].token_ids + observation
    before = session.stats
    session.submit("c", c_ids, 6, 7)
    session.step()
    assert (session.occupant >= 0).nonzero()[0].tolist() == [0]  # the decode step is one slot wide, not three
    assert session.slots.active.tolist() == [1, 0, 0]  # the idle slots' rows attend to one position
    rest = []
    while session.busy():
        rest += session.step()
    assert_same(dict(rest)["c"], fresh(model, tiny_tokenizer, c_ids, SAMPLED, 6, 7))
    assert session.stats["moves"] == 1
    # its K/V moved with it: only the last sampled token and the observation are prefilled
    assert session.stats["prefilled_tokens"] - before["prefilled_tokens"] == len(observation) + 1
    assert session.stats["recomputed_tokens"] == 0


@pytest.mark.parametrize("released,moves_to", [("ab", {"c": 0, "d": 1}), ("a", {"b": 1, "c": 0, "d": 2})])
def test_moves_admitted_together_copy_every_kv_before_any_is_overwritten(tiny_tokenizer, model, released, moves_to):
    """c and d move down in one admission; with only a released, d moves into the slot c just left
    (its K/V copied out in the same copy that brings d's in)."""
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig()).open_session(SAMPLED, 96, 4)
    observation = tiny_tokenizer.encode(OBSERVATION)
    texts = ("What is 12+7?", "Name a colour.", "hi", "Q: a city?")
    ids = {key: tiny_tokenizer.encode(text) for key, text in zip("abcd", texts)}
    for seed, key in enumerate("abcd"):
        session.submit(key, ids[key], 5, seed)
    first = {}
    while session.busy():
        first.update(session.step())
    for key in released:
        session.release(key)
    next_ids = {key: ids[key] + first[key].token_ids + observation for key in "cd"}
    for seed, key in enumerate("cd", start=10):
        session.submit(key, next_ids[key], 6, seed)
    finished = {}
    while session.busy():
        finished.update(session.step())
    assert session.slot_of == moves_to and session.stats["moves"] == 2
    for seed, key in enumerate("cd", start=10):
        assert_same(finished[key], fresh(model, tiny_tokenizer, next_ids[key], SAMPLED, 6, seed))
    assert session.stats["recomputed_tokens"] == 0


def test_fewer_slots_than_episodes_still_give_the_fresh_calls_outputs(tiny_tokenizer, model):
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=2))
    session = engine.open_session(SAMPLED, max_length=96, max_episodes=4)
    episodes = Episodes(tiny_tokenizer, 4)
    run_concurrently(session, episodes, [3, 1, 0, 2])
    assert len(episodes.turns) == 12
    for _, ids, cap, seed, output in episodes.turns:
        assert_same(output, fresh(model, tiny_tokenizer, ids, SAMPLED, cap, seed))
    stats = session.stats
    assert stats["evictions"] > 0 and stats["recomputed_tokens"] > 0
    # every turn's ids were either continued from its slot or prefilled
    assert stats["prefilled_tokens"] + stats["reused_tokens"] == sum(len(ids) for _, ids, *_ in episodes.turns)


def test_a_turn_waits_while_every_slot_generates(tiny_tokenizer, model):
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=1)).open_session(SAMPLED, 96, 2)
    first, second = tiny_tokenizer.encode("What is 12+7?"), tiny_tokenizer.encode("hi")
    session.submit("a", first, 8, 1)
    session.submit("b", second, 3, 2)
    finished = session.step()
    assert finished == [] and session.stats["prefilled_tokens"] == len(first)  # b waits for a's slot
    while session.busy():
        finished += session.step()
    assert [key for key, _ in finished] == ["a", "b"]
    assert session.stats["evictions"] == 1  # a was idle when b took its slot
    assert_same(finished[1][1], fresh(model, tiny_tokenizer, second, SAMPLED, 3, 2))


def test_stops_and_ignore_eos_finish_turns_as_generate_does(tiny_tokenizer, model):
    tok = tiny_tokenizer
    ids = tok.encode("What is 12+7?")
    free_run = fresh(model, tok, ids, SamplingParams(temperature=0.0), 16, 0).token_ids
    observation = tok.encode(OBSERVATION)
    stop_text = tok.decode(free_run[3:5])
    for params, first_finish in ((SamplingParams(temperature=0.0, stop=[stop_text], return_logprobs=True), "stop"),
                                 (SamplingParams(temperature=0.0, stop_token_ids=[free_run[6]]), "stop"),
                                 (SamplingParams(temperature=1.0, ignore_eos=True, return_logprobs=True), "length")):
        session = RolloutEngine(model, tok, RolloutEngineConfig()).open_session(params, 96, 1)
        trajectory = ids
        for turn in range(2):
            output = finish_turn(session, "a", trajectory, 16, turn)
            assert_same(output, fresh(model, tok, trajectory, params, 16, turn))
            if turn == 0:  # greedy: the free run, cut at its stop string or stop id
                assert output.finish_reason == first_finish
            trajectory = trajectory + output.token_ids + observation
        session.close()


def test_release_frees_the_slot_and_drops_a_turn_in_progress(tiny_tokenizer, model):
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=1)).open_session(SAMPLED, 96, 2)
    session.submit("a", tiny_tokenizer.encode("What is 12+7?"), 12, 1)
    assert session.step() == []  # a generates
    session.release("a")
    assert not session.busy()
    ids = tiny_tokenizer.encode("hi")
    output = finish_turn(session, "b", ids, 4, 2)  # nothing returned for a; b takes the freed slot
    assert session.stats["evictions"] == 0
    assert_same(output, fresh(model, tiny_tokenizer, ids, SAMPLED, 4, 2))
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.submit("c", ids, 4, 3)


def test_refusals_name_what_to_change(tiny_tokenizer, model):
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig())
    session = engine.open_session(SAMPLED, max_length=20, max_episodes=2)
    too_long = r"episode 'a': 15 ids \+ max_new_tokens=6 exceed the turn session's max_length=20"
    with pytest.raises(ValueError, match=too_long):
        session.submit("a", list(range(1, 16)), 6, 0)
    session.submit("a", list(range(1, 16)), 5, 0)
    with pytest.raises(ValueError, match="already has a turn in progress"):
        session.submit("a", list(range(1, 16)), 5, 0)
    with torch.no_grad():  # an optimizer step, in place: the slots' K/V belong to the old weights
        next(model.parameters()).mul_(0.5)
    with pytest.raises(RuntimeError, match="weights changed while a turn session was open"):
        session.step()
    # an engine without turn sessions says so; its caller generates each turn on the whole ids
    assert HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig()).open_session(SAMPLED, 20, 2) is None


def test_a_groups_first_turns_are_prefilled_once_and_continue_apart(tiny_tokenizer, model):
    session = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig()).open_session(SAMPLED, 96, 4)
    question = tiny_tokenizer.encode("What is 12+7?")
    observation = tiny_tokenizer.encode(OBSERVATION)
    for episode in range(4):  # one row's four episodes, each its own seed
        session.submit(episode, question, 6, episode)
    outputs = {}
    while session.busy():
        outputs.update(session.step())
    assert session.stats["prefilled_tokens"] == len(question)
    for episode in range(4):
        assert_same(outputs[episode], fresh(model, tiny_tokenizer, question, SAMPLED, 6, episode))
    # each second turn continues the slot that received the copied K/V
    for episode in range(4):
        ids = question + outputs[episode].token_ids + observation
        before = session.stats["prefilled_tokens"]
        assert_same(finish_turn(session, episode, ids, 5, 10 + episode),
                    fresh(model, tiny_tokenizer, ids, SAMPLED, 5, 10 + episode))
        assert session.stats["prefilled_tokens"] - before == len(observation) + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs of the decode step need a GPU")
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, return_logprobs=True), SAMPLED])
def test_on_a_gpu_the_graphed_session_gives_the_eager_fresh_calls_outputs(tiny_tokenizer, model, params):
    model = model.cuda()
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=2, compile=False))
    session = engine.open_session(params, max_length=96, max_episodes=4)
    episodes = Episodes(tiny_tokenizer, 4)
    run_concurrently(session, episodes, [0, 1, 2, 3])
    assert session.graphs.graphs and session.stats["evictions"] > 0
    eager = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(prefix_cache=False, cuda_graphs=False,
                                                                     compile=False))
    for _, ids, cap, seed, output in episodes.turns:
        expected = eager.generate([ids], dataclasses.replace(params, max_new_tokens=cap, seed=seed))[0]
        assert (output.token_ids, output.finish_reason) == (expected.token_ids, expected.finish_reason)
        assert output.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
