"""The built-in tasks of the built-in environments: calculator_arithmetic's 3-digit operands, exact answers
and copying drills, guess_number's games split by secret; both deterministic for a seed and played by their environment.
(tests/unit/data/test_builtin_tasks.py also runs its per-task checks on calculator_arithmetic.)"""

import asyncio
import re
from collections import Counter
from dataclasses import replace

import aligner_ext.agents.calculator  # noqa: F401 - registers the environment (aligner_ext/plugins.py imports it in runs)
import aligner_ext.agents.guess_number  # noqa: F401
from aligner_ext.agents.environment import environment_class
from aligner_ext.data.tasks import builtin_rows, sft_target
from aligner_ext.data.tasks.base import DRILLS, in_split
from aligner_ext.rewards.base import DATA_SOURCES

CALCULATION = re.compile(r"Compute (\d+)([+*])(\d+) with the calculator; answer in \\boxed\{\}\.")


def test_calculator_rows_hold_3_digit_operands_and_the_exact_answer():
    rows = builtin_rows("calculator_arithmetic", "train", 200, seed=0)
    symbols, digits = Counter(), Counter()
    for row in rows:
        a, symbol, b = CALCULATION.fullmatch(row.messages[-1]["content"]).groups()
        symbols[symbol] += 1
        digits.update((len(a), len(b)))
        assert not a.startswith("0") and not b.startswith("0")
        expected = int(a) + int(b) if symbol == "+" else int(a) * int(b)
        assert row.ground_truth == str(expected) and sft_target(row) == f"\\boxed{{{expected}}}"
        assert row.data_source == "calculator_arithmetic"
    assert set(symbols) == {"+", "*"} and set(digits) == {3}


def test_calculator_rows_split_by_the_hash_of_their_prompt():
    """Collisions among 1.6 million problems are too rare for disjoint samples to show the rule."""
    for split in ("train", "val"):
        assert all(in_split(row.messages[-1]["content"], "val") == (split == "val")
                   for row in builtin_rows("calculator_arithmetic", split, 100, seed=3))


def test_the_gold_answer_scores_one_in_the_calculator_environment():
    row = builtin_rows("calculator_arithmetic", "val", 1, seed=0)[0]
    env = environment_class(data_source=row.data_source)()

    async def answer(text):
        state = (await env.reset(row)).state
        await env.step({"role": "assistant", "content": text}, state)
        return await env.score(state)

    assert asyncio.run(answer(sft_target(row))).correct == 1.0
    assert asyncio.run(answer(f"\\boxed{{{int(row.ground_truth) + 1}}}")).score == 0.0
    assert DATA_SOURCES["calculator_arithmetic"] == "math_verify"  # without the tool: a single-turn math task


def test_calculator_drills_box_the_number_a_user_or_a_tool_gave():
    drills = DRILLS.get("calculator_arithmetic")(400, seed=0)
    assert len(drills) == 400 and drills == DRILLS.get("calculator_arithmetic")(400, seed=0)
    lengths, senders = Counter(), Counter()
    for messages, target in drills:
        given = messages[-1]["content"].split()[0]
        assert given.isdigit() and not given.startswith("0") and target == "\\boxed{" + given + "}"
        senders[messages[-1]["role"]] += 1
        lengths[len(given)] += 1
    assert senders == {"user": 200, "tool": 200} and set(lengths) == {3, 4, 5, 6}


def secrets(split, size, seed):
    return [int(row.ground_truth) for row in builtin_rows("guess_number", split, size, seed)]


def test_guess_number_rows_are_games_split_by_secret():
    train, val = secrets("train", 400, 0), secrets("val", 100, 1)
    assert set(train) | set(val) == set(range(1, 101)) and not set(train) & set(val)
    assert 10 <= len(set(val)) <= 30  # about 20% of the secrets are val's
    counts = Counter(val)
    assert max(counts.values()) - min(counts.values()) <= 1  # drawn in successive shuffles: no secret favoured
    row = builtin_rows("guess_number", "train", 1, seed=0)[0]
    assert row.messages == [{"role": "user", "content": "Guess my number from 1 to 100. Each turn, answer with one "
                                                        "number; I reply higher or lower. You have 7 guesses."}]
    assert row.extra_info == {"gold_solution": "50", "low": 1, "high": 100, "max_guesses": 7}
    assert environment_class(data_source=row.data_source).__name__ == "GuessNumberEnvironment"


def test_guess_number_is_deterministic_for_a_seed():
    assert builtin_rows("guess_number", "train", 50, seed=7) == builtin_rows("guess_number", "train", 50, seed=7)
    assert secrets("train", 50, 7) != secrets("train", 50, 8)
    assert [row.row_id for row in builtin_rows("guess_number", "val", 3, seed=7)] == [
        "builtin/guess_number/val:0", "builtin/guess_number/val:1", "builtin/guess_number/val:2"]


def test_bisection_wins_every_game_within_the_guesses():
    """Seven guesses suffice over 1..100: playing bisection against every secret finds each one."""
    env = environment_class("guess_number")()

    async def bisect(row):
        state, low, high = (await env.reset(row)).state, 1, 100
        while True:
            guess = (low + high) // 2
            result = await env.step({"role": "assistant", "content": str(guess)}, state)
            if result.done:
                return (await env.score(state)).score
            low, high = (guess + 1, high) if result.messages[0]["content"] == "higher" else (low, guess - 1)

    row = builtin_rows("guess_number", "train", 1, seed=0)[0]
    scores = [asyncio.run(bisect(replace(row, ground_truth=str(secret)))) for secret in range(1, 101)]
    assert min(scores) >= 0.9 ** 6 > 0  # found within 7 guesses every time
