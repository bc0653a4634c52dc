"""`guess_number`: a multi-turn game with feedback, no tools.

The user message (the `guess_number` task, data/tasks) asks for a secret integer from `low` to `high`;
each model turn is one guess, the last integer in its text. The environment answers "higher" or
"lower" as a user message, or "Answer with one number from <low> to <high>." when the turn holds no
integer (that turn still counts as a guess). The episode ends when a guess is right or after
`max_guesses` guesses. The row supplies the game: `ground_truth` is the secret, `extra_info` holds
`low`, `high` and `max_guesses`.

Reward (decision): `DISCOUNT ** (guesses - 1)` when the secret is found, 0.0 otherwise: 1.0 on the
first guess, 0.729 on the fourth, 0.531 on the seventh (the worst case of bisecting 1..100), so a
GRPO group prefers the shorter searches and every success beats every failure. No per-turn rewards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aligner_ext.agents.environment import Environment, Episode, Message, StepResult, register_environment
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult

DISCOUNT = 0.9  # the score's factor per guess after the first
INTEGER = re.compile(r"-?\d+")


@dataclass
class GuessState:
    """One game."""

    secret: int
    low: int
    high: int
    max_guesses: int
    guesses: int = 0  # taken so far
    found: bool = False


@register_environment("guess_number", data_sources=("guess_number",))
class GuessNumberEnvironment(Environment):
    """Higher / lower feedback until the secret is guessed or the guesses run out (module docstring)."""

    async def reset(self, row: PromptRow) -> Episode:
        game = row.extra_info
        missing = [f"extra_info.{key}" for key in ("low", "high", "max_guesses") if key not in game]
        missing += ["ground_truth"] if row.ground_truth is None else []
        if missing:
            raise ValueError(f"row {row.row_id}: a guess_number row needs ground_truth (the secret) and extra_info "
                             f"low, high and max_guesses; missing: {', '.join(missing)}")
        state = GuessState(int(row.ground_truth), int(game["low"]), int(game["high"]), int(game["max_guesses"]))
        return Episode([dict(message) for message in row.messages], state=state)

    async def step(self, assistant_message: Message, state: GuessState) -> StepResult:
        state.guesses += 1
        numbers = INTEGER.findall(assistant_message.get("content") or "")
        state.found = bool(numbers) and int(numbers[-1]) == state.secret
        if state.found or state.guesses >= state.max_guesses:
            return StepResult(done=True)
        if not numbers:
            feedback = f"Answer with one number from {state.low} to {state.high}."
        else:
            feedback = "higher" if int(numbers[-1]) < state.secret else "lower"
        return StepResult([{"role": "user", "content": feedback}])

    async def score(self, state: GuessState) -> RewardResult:
        """The reward with whether the secret was found, so held-out accuracy is defined."""
        return RewardResult(DISCOUNT ** (state.guesses - 1) if state.found else 0.0, correct=float(state.found))
