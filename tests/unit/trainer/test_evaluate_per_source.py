"""Held-out evaluation reports accuracy and mean reward per data_source when the validation set has
more than one, each against values worked out by hand."""

import math

import pytest

from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.generation.base import GenerationOutput, SamplingParams
from aligner_ext.rewards.base import RewardResult
from aligner_ext.trainer.evaluate import evaluate

# row id -> (data_source, reward, correct); None: the reward reports no correctness
TABLE = {
    "a0": ("math", 1.0, 1.0),
    "a1": ("math", 0.25, 0.0),
    "b0": ("qa", 0.2, None),
    "a2": ("math", 0.5, 1.0),
    "b1": ("qa", 0.9, 0.0),
}


class EchoEngine:
    """Answers each prompt with its own ids, so the response names its row."""

    def __init__(self):
        self.params = []

    def generate(self, prompts, params):
        self.params.append(params)
        return [GenerationOutput(token_ids=list(prompt), finish_reason="stop") for prompt in prompts]


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class TableRewards:
    """Scores a response by the row it answers, after checking that the two were paired right."""

    def score(self, texts, rows):
        assert list(texts) == [row.row_id for row in rows]
        return [RewardResult(score=TABLE[row.row_id][1], correct=TABLE[row.row_id][2]) for row in rows]


class ListLoader:
    def __init__(self, ids, batch_size):
        self.draws = [PromptDraw(PromptRow(row_id=i, messages=[], data_source=TABLE[i][0]), [ord(c) for c in i], n)
                      for n, i in enumerate(ids)]
        self.batch_size = batch_size

    def iterate_once(self):
        for start in range(0, len(self.draws), self.batch_size):
            yield self.draws[start : start + self.batch_size]


def run(ids, batch_size=2):
    engine = EchoEngine()
    metrics = evaluate(engine, TableRewards(), CharTokenizer(), ListLoader(ids, batch_size),
                       SamplingParams(max_new_tokens=4, temperature=0.0, stop=["\n"]))
    assert all(p.temperature == 0.0 for p in engine.params)
    return metrics


def test_two_sources_get_their_own_accuracy_and_reward():
    metrics = run(list(TABLE))  # batches of 2 mix the sources
    # overall: correct [1, 0, -, 1, 0] -> 2 / 4; rewards (1 + 0.25 + 0.2 + 0.5 + 0.9) / 5
    assert metrics["val/accuracy"] == pytest.approx(0.5)
    assert metrics["val/reward_mean"] == pytest.approx(2.85 / 5)
    assert metrics["val/num_prompts"] == 5
    # math: correct [1, 0, 1] -> 2/3, rewards (1 + 0.25 + 0.5) / 3; qa: correct [-, 0] -> 0, rewards (0.2 + 0.9) / 2
    assert metrics["val/math/accuracy"] == pytest.approx(2 / 3)
    assert metrics["val/math/reward_mean"] == pytest.approx(1.75 / 3)
    assert metrics["val/qa/accuracy"] == 0.0
    assert metrics["val/qa/reward_mean"] == pytest.approx(0.55)
    assert metrics["val/response_length"] == pytest.approx(2.0)  # each echoed id is two characters
    assert {k for k in metrics if k.count("/") == 2} == {
        "val/math/accuracy", "val/math/reward_mean", "val/qa/accuracy", "val/qa/reward_mean"}


def test_a_source_without_correctness_has_undefined_accuracy():
    metrics = run(["a0", "b0", "a1"], batch_size=3)
    assert math.isnan(metrics["val/qa/accuracy"]) and metrics["val/qa/reward_mean"] == pytest.approx(0.2)
    assert metrics["val/math/accuracy"] == pytest.approx(0.5)


def test_one_source_reports_the_overall_metrics_only():
    metrics = run(["a0", "a1", "a2"])
    assert set(metrics) == {"val/accuracy", "val/reward_mean", "val/response_length", "val/num_prompts"}
    assert metrics["val/accuracy"] == pytest.approx(2 / 3)
