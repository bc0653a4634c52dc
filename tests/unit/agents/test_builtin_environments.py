"""The built-in environments: the calculator tool (exact integer arithmetic, nothing else evaluated) and
its environment scoring the final answer, and the number-guessing game's feedback, end and reward."""

import asyncio

import pytest

from aligner_ext.agents.calculator import CalculatorEnvironment, calculator
from aligner_ext.agents.environment import environment_class
from aligner_ext.agents.guess_number import GuessNumberEnvironment
from aligner_ext.data.types import PromptRow


def assistant(content="", calls=()):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
                                 for e in calls]
    return message


def play(env, row, turns):
    """reset, then one step per scripted assistant message until done; the step results and the score."""

    async def episode():
        state = (await env.reset(row)).state
        results = []
        for message in turns:
            results.append(await env.step(message, state))
            if results[-1].done:
                break
        return results, await env.score(state), state

    return asyncio.run(episode())


@pytest.mark.parametrize("expression, value", [
    ("(123456 + 789) * 12", "1490940"),  # 124245 * 12
    ("123456789*987654321", "121932631112635269"),  # float64 would give ...264
    ("7/2", "7/2"),
    ("10 / 4 * 2", "5"),
    ("-3*-3", "9"),
    (" 2 - (5 - 1) ", "-2"),
])
def test_the_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error, message", [
    ("2**10", ValueError, "'2 \\*\\* 10' is not arithmetic on integers"),
    ("7//2", ValueError, "'7 // 2' is not arithmetic on integers"),
    ("__import__('os').system('true')", ValueError, "use only integers"),
    ("1.5+1", ValueError, "use only integers"),
    ("0x10", ValueError, "use only integers"),
    ("(1+2", ValueError, "not an arithmetic expression"),
    ("", ValueError, "not an arithmetic expression"),
    ("1" * 201, ValueError, "longer than 200 characters"),
    ("1/(2-2)", ZeroDivisionError, "division by zero"),
])
def test_the_calculator_refuses_everything_else(expression, error, message):
    with pytest.raises(error, match=message):
        calculator(expression)


CALC_ROW = PromptRow("c:0", [{"role": "user", "content": "Compute 443604737+907509316."}], "calculator_arithmetic",
                     ground_truth="1351114053")


def test_a_calculator_episode_is_scored_on_its_final_answer():
    results, score, state = play(CalculatorEnvironment(), CALC_ROW, [
        assistant(calls=["443604737+907509316"]),
        assistant("The sum is \\boxed{1351114053}."),
    ])
    assert results[0].messages == [{"role": "tool", "name": "calculator", "content": "1351114053"}]
    assert [result.done for result in results] == [False, True] and (score.score, score.correct) == (1.0, 1.0)
    assert results[0].metrics == {"tool_seconds": results[0].metrics["tool_seconds"]}  # no error


def test_a_wrong_or_missing_final_answer_scores_zero():
    assert play(CalculatorEnvironment(), CALC_ROW, [assistant("\\boxed{1351114054}")])[1].correct == 0.0
    assert play(CalculatorEnvironment(), CALC_ROW, [assistant("1351114053")])[1].score == 0.0  # not marked as the answer


def test_a_raising_expression_is_the_models_observation():
    results, score, state = play(CalculatorEnvironment(), CALC_ROW, [assistant(calls=["1/0", "2**3"])])
    assert results[0].messages == [
        {"role": "tool", "name": "calculator", "content": "Error: calculator raised ZeroDivisionError: division by zero"},
        {"role": "tool", "name": "calculator",
         "content": "Error: calculator raised ValueError: '2 ** 3' is not arithmetic on integers"}]
    assert results[0].metrics["tool_errors_exception"] == 2 and not results[0].done


def test_the_environments_are_found_by_name_and_data_source():
    assert environment_class("calculator") is CalculatorEnvironment
    assert environment_class(data_source="calculator_arithmetic") is CalculatorEnvironment
    assert environment_class("guess_number") is GuessNumberEnvironment
    assert environment_class(data_source="guess_number") is GuessNumberEnvironment


def game(secret, max_guesses=7):
    return PromptRow("g:0", [{"role": "user", "content": "Guess my number from 1 to 100."}], "guess_number",
                     ground_truth=str(secret), extra_info={"low": 1, "high": 100, "max_guesses": max_guesses})


def test_the_game_answers_higher_or_lower_until_found():
    turns = [assistant("50"), assistant("Then 25."), assistant("hmm"), assistant("90 or 10? 30"),
             assistant("Not 36, so 37"), assistant("never asked")]  # a guess is the turn's last integer
    results, score, state = play(GuessNumberEnvironment(), game(37), turns)
    assert [result.messages for result in results] == [
        [{"role": "user", "content": "lower"}], [{"role": "user", "content": "higher"}],
        [{"role": "user", "content": "Answer with one number from 1 to 100."}],
        [{"role": "user", "content": "higher"}], []]
    assert [result.done for result in results] == [False, False, False, False, True]
    assert score.score == pytest.approx(0.9 ** 4) and score.correct == 1.0  # found on the fifth guess
    assert all(result.reward is None for result in results)


def test_the_game_ends_after_its_guesses_and_scores_zero():
    results, score, _ = play(GuessNumberEnvironment(), game(37, max_guesses=3),
                             [assistant("50"), assistant("40"), assistant("38"), assistant("37")])
    assert [result.done for result in results] == [False, False, True] and results[-1].messages == []
    assert (score.score, score.correct) == (0.0, 0.0)


def test_a_first_guess_scores_one_and_games_run_concurrently():
    env = GuessNumberEnvironment()

    async def two_games():
        high, low = await env.reset(game(80)), await env.reset(game(20))
        results = await asyncio.gather(env.step(assistant("50"), high.state), env.step(assistant("50"), low.state))
        return [result.messages[0]["content"] for result in results]

    assert asyncio.run(two_games()) == ["higher", "lower"]
    assert play(env, game(50), [assistant("50")])[1].score == 1.0


def test_a_row_without_the_game_is_refused_with_what_is_missing():
    row = PromptRow("g:7", [{"role": "user", "content": "Guess."}], "guess_number", extra_info={"low": 1})
    with pytest.raises(ValueError, match="row g:7: .* missing: extra_info.high, extra_info.max_guesses, ground_truth"):
        asyncio.run(GuessNumberEnvironment().reset(row))
