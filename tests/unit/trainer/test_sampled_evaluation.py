"""Sampled held-out evaluation (trainer/evaluate.py): the unbiased pass@k estimator against enumerating
every k-subset, mean@k and maj@k on hand-worked prompts (ties and missing answers included), an
evaluation of two validation sets on a scripted engine, the greedy default left as it was, and the
refusal of sampled evaluation with a maker that evaluates its own way."""

import itertools
import math
from collections import Counter
from types import SimpleNamespace

import pytest

from aligner_ext.config import load_config
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.generation.base import GenerationOutput
from aligner_ext.rewards.base import RewardResult
from aligner_ext.trainer.build import check_evaluation
from aligner_ext.trainer.evaluate import (
    Evaluator,
    PromptResponses,
    default_pass_at,
    majority_correct,
    pass_at_k,
    set_metrics,
)


def enumerated_pass_at(n, c, k):
    """The share of the k-subsets of n responses (the first c correct) holding a correct one, in float64."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_enumerating_every_subset(n):
    for c in range(n + 1):  # c = 0 and c = n included
        for k in range(1, n + 1):  # k = n included
            assert pass_at_k(n, c, k) == enumerated_pass_at(n, c, k), (n, c, k)


def test_pass_at_k_stays_exact_where_float_binomials_overflow():
    # C(2000, 1000) is about 2e600, past float64; Chen et al.'s product form of the same estimator:
    product = 1.0 - math.prod(1.0 - 1000 / i for i in range(2000 - 3 + 1, 2001))
    assert pass_at_k(2000, 3, 1000) == pytest.approx(product, rel=1e-12)
    assert pass_at_k(100, 1, 1) == 0.01 and pass_at_k(100, 0, 50) == 0.0 and pass_at_k(100, 51, 50) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_default_pass_at_is_powers_of_two_below_k_and_k():
    assert [default_pass_at(k) for k in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]


@pytest.mark.parametrize("answers, correct, expected", [
    (["4", "4", "5", "4"], [1, 1, 0, 1], 1.0),  # the majority is right
    (["5", "5", "4"], [0, 0, 1], 0.0),  # the majority is wrong, though one response is right
    (["4", "5"], [1, 0], 0.5),  # a tie: the expected outcome of a random tie-break
    (["4", "5", "4", "5", "6"], [1, 0, 1, 0, 0], 0.5),  # 4 and 5 tie at two votes; 6 is out
    (["4", "5", "6"], [1, 0, 0], 1 / 3),  # three-way tie
    ([None, None, "4"], [0, 0, 1], 1.0),  # responses without an answer do not vote
    ([None, None, "5"], [0, 0, 0], 0.0),
    ([None, None], [0, 0], 0.0),  # nobody answered: wrong
])
def test_majority_vote(answers, correct, expected):
    assert majority_correct(answers, [float(value) for value in correct]) == pytest.approx(expected)


def prompt(source, correct, answers=None, scores=None):
    return PromptResponses(source=source, scores=scores or [float(c) for c in correct],
                           correct=[float(c) for c in correct], lengths=[1] * len(correct), answers=answers)


def test_mean_pass_and_majority_of_a_set_by_hand():
    nan = math.nan
    prompts = [
        prompt("math", [1, 1, 0, 1], ["4", "4", "5", "4"]),  # c = 3 of 4, majority right
        prompt("math", [0, 0, 1, 0], ["8", "8", "9", None]),  # c = 1, majority wrong
        prompt("rubric", [nan, nan, nan, nan]),  # no correctness, no answers
    ]
    metrics = set_metrics(prompts, k=4, pass_at=[1, 2, 4])
    assert metrics["val/accuracy"] == 0.5  # 4 correct of 8 judged responses
    assert metrics["val/mean_at_4"] == 0.5  # (3/4 + 1/4) / 2; the rubric prompt has no mean
    assert metrics["val/pass_at_1"] == 0.5
    # pass@2: 1 - C(1, 2)/C(4, 2) = 1 and 1 - C(3, 2)/C(4, 2) = 1/2; pass@4: 1 and 1
    assert metrics["val/pass_at_2"] == 0.75 and metrics["val/pass_at_4"] == 1.0
    assert "val/maj_at_4" not in metrics  # the rubric prompt's reward extracts no answer
    assert metrics["val/math/maj_at_4"] == 0.5 and "val/rubric/maj_at_4" not in metrics
    assert math.isnan(metrics["val/rubric/accuracy"]) and math.isnan(metrics["val/rubric/pass_at_1"])
    assert metrics["val/num_prompts"] == 3.0


# row id -> (data_source, gold, the 4 responses, in the order the engine draws them)
SCRIPT = {
    "p1": ("math", "4", ["4", "4", "5", "4"]),
    "p2": ("math", "9", ["8", "8", "9", ""]),
    "p3": ("qa", "x", ["x", "y", "y", "x"]),
    "p4": ("rubric", "z", ["z", "w", "w", "w"]),
}


class ScriptedEngine:
    """Answers the j-th copy of a prompt (its row id in ids) with the j-th scripted response of the row."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(([bytes(prompt).decode() for prompt in prompts], params))
        seen = Counter()
        outputs = []
        for prompt in prompts:
            row_id = bytes(prompt).decode()
            outputs.append(GenerationOutput(token_ids=list(SCRIPT[row_id][2][seen[row_id]].encode()),
                                            finish_reason="eos"))
            seen[row_id] += 1
        return outputs


class ScriptedRewards:
    """Correct when the response is the gold; the answer is the response (none when empty), except for
    the rubric source, whose reward extracts none."""

    def score(self, texts, rows):
        return [RewardResult(score=float(text == row.ground_truth), correct=float(text == row.ground_truth),
                             answer=text or None) for text, row in zip(texts, rows)]

    def extracts_answer(self, row):
        return row.data_source != "rubric"


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()


class ListLoader:
    def __init__(self, ids, batch_size=8):
        self.draws = [PromptDraw(PromptRow(row_id=i, messages=[], data_source=SCRIPT[i][0], ground_truth=SCRIPT[i][1]),
                                 list(i.encode()), n) for n, i in enumerate(ids)]
        self.batch_size = batch_size

    def iterate_once(self):
        for start in range(0, len(self.draws), self.batch_size):
            yield self.draws[start:start + self.batch_size]


class SingleRoundMaker:
    def evaluate(self, loader, single_round):
        return single_round(loader)


def evaluator(overrides, loaders):
    cfg = load_config("base", overrides)
    parts = SimpleNamespace(engine=ScriptedEngine(), rewards=ScriptedRewards(), tokenizer=Tokenizer(),
                            maker=SingleRoundMaker(), val_loaders=loaders)
    return Evaluator(cfg, parts), parts.engine


def test_two_validation_sets_sampled_four_times():
    run, engine = evaluator(["trainer.eval.k=4", "trainer.eval.temperature=0.7", "trainer.eval.top_p=0.9"],
                            {"arith": ListLoader(["p1", "p2"]), "mixed": ListLoader(["p3", "p4"])})
    metrics = run(3)
    # one engine call per set's batch, each prompt four times in a row, at the evaluation's sampling
    assert [prompts for prompts, _ in engine.calls] == [["p1"] * 4 + ["p2"] * 4, ["p3"] * 4 + ["p4"] * 4]
    assert {(p.temperature, p.top_p) for _, p in engine.calls} == {(0.7, 0.9)}
    assert engine.calls[0][1].seed != engine.calls[1][1].seed
    common = {"accuracy", "reward_mean", "mean_at_4", "pass_at_1", "pass_at_2", "pass_at_4"}
    assert set(metrics) == (
        {f"val/arith/{name}" for name in common | {"maj_at_4", "response_length", "num_prompts"}}
        | {f"val/mixed/{name}" for name in common | {"response_length", "num_prompts"}}
        | {f"val/mixed/qa/{name}" for name in common | {"maj_at_4"}} | {f"val/mixed/rubric/{name}" for name in common}
        | {f"val/{name}" for name in common | {"response_length", "num_prompts"}})
    # arith: p1 correct [1, 1, 0, 1], p2 [0, 0, 1, 0] (its "" response has no answer)
    assert (metrics["val/arith/accuracy"], metrics["val/arith/mean_at_4"], metrics["val/arith/pass_at_2"]) == (
        0.5, 0.5, 0.75)
    assert metrics["val/arith/maj_at_4"] == 0.5  # p1's majority "4" is right, p2's "8" wrong
    assert metrics["val/arith/response_length"] == 7 / 8
    # mixed: p3 (qa) [1, 0, 0, 1], x and y tie: maj 1/2; p4 (rubric) [1, 0, 0, 0], no answers
    assert metrics["val/mixed/accuracy"] == 3 / 8 and metrics["val/mixed/qa/maj_at_4"] == 0.5
    assert metrics["val/mixed/qa/pass_at_2"] == pytest.approx(1 - 1 / 6)
    assert metrics["val/mixed/rubric/pass_at_2"] == pytest.approx(1 - 3 / 6)
    assert metrics["val/mixed/pass_at_2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    # the bare keys pool both sets, two prompts each; maj@4 only arith has, so it is not pooled
    assert metrics["val/num_prompts"] == 4.0
    assert metrics["val/accuracy"] == pytest.approx((0.5 + 3 / 8) / 2)
    assert metrics["val/pass_at_2"] == pytest.approx((0.75 + (5 / 6 + 1 / 2) / 2) / 2)
    assert metrics["val/response_length"] == pytest.approx((7 / 8 + 1) / 2)


def test_the_sampling_is_seeded_by_step_set_and_call():
    run, engine = evaluator(["trainer.eval.k=4", "trainer.eval.temperature=1"], {"arith": ListLoader(["p1", "p2"], 1)})
    run(3), run(3), run(4)
    seeds = [params.seed for _, params in engine.calls]
    assert seeds[:2] == seeds[2:4] and len(set(seeds[:2] + seeds[4:])) == 4  # two calls per evaluation


def test_the_greedy_default_is_one_response_per_prompt_with_the_metrics_as_before():
    cfg = load_config("base")
    assert (cfg.trainer.eval.k, cfg.trainer.eval.temperature, cfg.trainer.eval.describe()) == (1, 0.0, "greedy")
    run, engine = evaluator([], {"val": ListLoader(["p1", "p3"])})
    metrics = run(0)
    ((prompts, params),) = engine.calls
    assert prompts == ["p1", "p3"] and params.temperature == 0.0
    assert (params.max_new_tokens, params.stop) == (cfg.rollout.max_response_length, cfg.rollout.stop)
    # one set, two sources: the keys greedy evaluation always reported, and no others
    assert set(metrics) == {"val/accuracy", "val/reward_mean", "val/response_length", "val/num_prompts",
                            "val/math/accuracy", "val/math/reward_mean", "val/qa/accuracy", "val/qa/reward_mean"}
    assert metrics["val/accuracy"] == 1.0 and metrics["val/num_prompts"] == 2.0  # each first response is right


def test_due_before_training_every_n_steps_and_at_the_end():
    run, _ = evaluator(["trainer.eval.every=4", "trainer.total_steps=10"], {})
    assert [step for step in range(1, 11) if run.due(step)] == [4, 8, 10]
    assert run(0) == {}  # no validation set: nothing to evaluate


def test_the_old_key_and_verls_are_read_as_the_evaluation_settings():
    assert load_config("base", ["trainer.eval_every=5"]).trainer.eval.every == 5
    cfg = load_config("base", ["actor_rollout_ref.rollout.val_kwargs.n=8",
                               "actor_rollout_ref.rollout.val_kwargs.temperature=0.6"])
    assert (cfg.trainer.eval.k, cfg.trainer.eval.temperature, cfg.trainer.eval.describe()) == (
        8, 0.6, "8 samples, temperature 0.6")


@pytest.mark.parametrize("overrides, says", [
    (["trainer.eval.k=4"], "greedy decoding gives the same response k times"),
    (["trainer.eval.k=4", "trainer.eval.temperature=1", "trainer.eval.pass_at=[1,8]"], "at most trainer.eval.k=4"),
    (["trainer.eval.pass_at=[1]"], "pass@j is reported for trainer.eval.k > 1"),
    (["trainer.eval.k=4", "trainer.eval.temperature=1", "trainer.eval.pass_at=[0]"],
     r"trainer.eval.pass_at=\[0\]: must be a list, each item a finite number >= 1; 0 is not"),
])
def test_settings_that_cannot_run_are_refused(overrides, says):
    with pytest.raises(ValueError, match=says):
        load_config("base", overrides)


def test_sampled_evaluation_is_refused_with_a_maker_that_evaluates_its_own_way():
    sampled = ["trainer.eval.k=4", "trainer.eval.temperature=1"]
    with pytest.raises(ValueError, match=r"^trainer.eval.k=4, trainer.eval.temperature=1 with experience maker "
                                         r"two_round \(algorithm.experience_maker\): it evaluates two greedy rounds"):
        load_config("base", ["+variant=mtpo", *sampled])  # at load, before anything is built
    check_evaluation(load_config("base", ["+variant=mtpo"]))  # its greedy default is its own evaluation
    for variant in ("dapo", "cpo", "graded_prompt"):  # single-round makers and wrappers compose
        check_evaluation(load_config("base", [f"+variant={variant}", *sampled]))
