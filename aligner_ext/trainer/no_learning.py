"""Runs that cannot learn say so: a watch over each step's logged metrics.

A step changes the policy only when some sample has a non-zero advantage and the optimizer applies
a non-zero update. A run where that lasts exits 0 with plausible curves and has trained nothing. A
step *cannot learn* when its metrics show any of:

- no update applied (`actor/num_updates` 0 or absent: an empty batch, every update skipped);
- no non-zero advantage (`advantage/min` and `advantage/max` within ADVANTAGE_EPS of 0);
- a zero gradient (`actor/grad_norm` 0);
- a learning rate of 0 (the rate the step's update ran at, below).

One such step is ordinary (every group of the batch right, say), so `trainer.no_learning_steps`
of them in a row get one warning naming the likely causes the metrics tell apart (the texts below:
every reward a fallback, identical samples, one reward for the whole batch, rewards that agree
within every group, no batch reached training, a zero learning rate). The run's summary repeats it
for the whole run (`run_warnings` replays metrics.jsonl, so the steps before a resume count too; the
log's count starts again at a resume).

Separately, a step where every group's samples are token-identical although the rollout samples
(temperature > 0, groups of two or more: `rollout/identical_group_fraction` 1, experience/base.py)
is warned at once: sampling at a useful temperature does not give that, a generation server applying
one seed to a whole request does (or a policy collapsed to one answer per prompt).

Decisions (tests/unit/trainer/test_no_learning.py pins them):
- Only backend-neutral names are read: both policy backends report `actor/*` through
  `models/base.update_metrics` and `actor/lr`; the rest comes from the batch (trainer/step_metrics.py)
  and the experience maker. The loop feeds it whatever the step logged; no variant decides anything here.
- `actor/lr` is the rate after the step's schedule step (the next update's, on both backends), so a
  step's update ran at the rate the previous step reported (the first step watched: its own). A
  schedule decaying to 0 reports 0 after its last update only, which is no zero-rate update.
- `actor/update_ratio_max` (the change of the weights' norm) is no trigger: a real update at a small
  learning rate can leave a float32 norm unchanged (the small e2e run at lr=1e-8 logs 0 at every step,
  its gradient norm 0.5).
- A stretch of steps that cannot learn warns once, when it reaches the count; a later stretch warns
  again. Identical samples warn on the first step of each run of such steps.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from aligner_ext.trainer.step_metrics import ZERO_STD_EPS

logger = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-6  # |advantage| at or below this is no signal (groups without spread get exactly 0)
STRETCHES_NAMED = 5  # stretches the summary names before counting the rest

# The likely causes, in the order a warning names them.
FALLBACKS = ("every reward was reward.fallback_score (the reward function raised or timed out on every call: "
             "see its warnings)")
IDENTICAL = ("every group's samples were token-identical although rollout.temperature={temperature} samples "
             "(rollout/identical_group_fraction 1: a generation server giving a whole request one seed, a "
             "temperature too low to vary, or a policy collapsed to one answer per prompt)")
CONSTANT = ("every reward of the batch had the same value (a reward that returns a constant, empty ground truths "
            "or prompts, or a task the model always fails or always passes)")
AGREEING = ("the rewards agreed within every group, not across groups (each prompt all right or all wrong: the task "
            "too hard or too easy for the model)")
ZERO_ADVANTAGE = ("every trained token's advantage was 0 although rewards varied within groups (an advantage "
                  "wrapper zeroed them, or every token was masked out of the loss)")
NO_BATCH = "no sample reached training (a filter dropped every group, e.g. dynamic sampling giving up)"
SKIPPED = "every optimizer update was skipped (actor/skipped_updates: a non-finite loss or gradient)"
ZERO_LR = "the learning rate was 0 (policy.optim.lr or its schedule)"
ZERO_GRADIENT = "the gradient was 0 although the advantages were not"
CAUSES = (FALLBACKS, IDENTICAL, CONSTANT, AGREEING, ZERO_ADVANTAGE, NO_BATCH, SKIPPED, ZERO_LR, ZERO_GRADIENT)


@dataclass
class Stretch:
    """Consecutive steps that could not learn, and the causes their metrics showed."""

    first: int
    last: int
    causes: set[str] = field(default_factory=set)

    @property
    def steps(self) -> int:
        return self.last - self.first + 1

    @property
    def span(self) -> str:
        return f"{self.first}-{self.last}" if self.last > self.first else str(self.first)

    @property
    def named(self) -> str:
        return f"steps {self.span}" if self.last > self.first else f"step {self.first}"


class NoLearningDetector:
    """Fed each training step's metrics in order (`observe`); warns in the log when `log` is on, and
    holds the run's findings for the summary (`findings`)."""

    def __init__(self, steps_in_a_row: int, temperature: float, log: bool = True):
        if steps_in_a_row < 1:
            raise ValueError(f"trainer.no_learning_steps must be >= 1, got {steps_in_a_row}")
        self.steps_in_a_row = steps_in_a_row
        self.temperature = temperature
        self.log = log
        self.stretches: list[Stretch] = []  # the last one is open while its steps go on
        self.open = False
        self.identical_steps: list[int] = []
        self.previous_identical = False
        self.steps = 0
        self.rate: float | None = None  # the learning rate the next update runs at (the last `actor/lr`)

    def observe(self, step: int, metrics: dict[str, float | None]) -> None:
        self.steps += 1
        reported = _number(metrics, "actor/lr")
        rate = reported if self.rate is None else self.rate
        self.rate = reported if reported is not None else self.rate  # a step without an update keeps the rate
        identical = self.temperature > 0 and _number(metrics, "rollout/identical_group_fraction") == 1.0
        if identical and not self.previous_identical:
            self._warn(f"step {step}: {IDENTICAL.format(temperature=self.temperature)}; such groups carry no "
                       "learning signal")
        if identical:
            self.identical_steps.append(step)
        self.previous_identical = identical
        causes = self._causes(metrics, rate, identical)
        if causes is None:
            self.open = False
            return
        if not self.open:
            self.stretches.append(Stretch(step, step))
            self.open = True
        stretch = self.stretches[-1]
        stretch.last = step
        stretch.causes |= causes
        if stretch.steps == self.steps_in_a_row:
            self._warn(f"{stretch.named}: the policy could not learn for {_steps(stretch.steps)} in a row "
                       f"(trainer.no_learning_steps={self.steps_in_a_row}); {self._describe(stretch.causes)}")

    def findings(self) -> list[str]:
        """The summary's lines: the stretches that reached the count, and the steps of identical samples."""
        lines = []
        reached = [stretch for stretch in self.stretches if stretch.steps >= self.steps_in_a_row]
        if reached:
            spans = ", ".join(stretch.span for stretch in reached[:STRETCHES_NAMED])
            if len(reached) > STRETCHES_NAMED:
                spans += f" and {len(reached) - STRETCHES_NAMED} more"
            lines.append(f"the policy could not learn in {sum(stretch.steps for stretch in reached)} of "
                         f"{_steps(self.steps)}, in stretches of {self.steps_in_a_row} or more in a row (steps {spans}; "
                         f"trainer.no_learning_steps); {self._describe(set().union(*(s.causes for s in reached)))}")
        if self.identical_steps:
            lines.append(f"{IDENTICAL.format(temperature=self.temperature)} at {len(self.identical_steps)} of "
                         f"{_steps(self.steps)} "
                         f"(first: step {self.identical_steps[0]})")
        return lines

    def _causes(self, metrics: dict[str, float | None], rate: float | None, identical: bool) -> set[str] | None:
        """None when the step could learn, else the causes its metrics show."""
        no_update = not _number(metrics, "actor/num_updates")
        no_advantage = max(abs(_number(metrics, "advantage/min") or 0.0),
                           abs(_number(metrics, "advantage/max") or 0.0)) <= ADVANTAGE_EPS
        zero_gradient = _number(metrics, "actor/grad_norm") == 0.0
        if not (no_update or no_advantage or zero_gradient or rate == 0.0):
            return None
        causes = set()
        if _number(metrics, "reward/fallback_fraction") == 1.0:
            causes.add(FALLBACKS)
        if identical:
            causes.add(IDENTICAL.format(temperature=self.temperature))
        if no_update:
            causes.add(SKIPPED if "batch/num_samples" in metrics else NO_BATCH)
        elif no_advantage and not causes:  # fallbacks and identical samples explain agreeing rewards
            if _number(metrics, "reward/zero_std_group_fraction") != 1.0:
                causes.add(ZERO_ADVANTAGE)
            elif (_number(metrics, "reward/std") or 0.0) <= ZERO_STD_EPS:
                causes.add(CONSTANT)
            else:
                causes.add(AGREEING)
        if rate == 0.0:
            causes.add(ZERO_LR)
        if zero_gradient and not no_advantage:
            causes.add(ZERO_GRADIENT)
        return causes

    def _describe(self, causes: set[str]) -> str:
        order = [cause.format(temperature=self.temperature) for cause in CAUSES]
        return "likely cause: " + "; ".join(sorted(causes, key=order.index))

    def _warn(self, line: str) -> None:
        if self.log:
            logger.warning(line)


def run_warnings(history: list[dict], steps_in_a_row: int, temperature: float) -> list[str]:
    """The detector's findings over a run's metrics.jsonl records (step 0 is the evaluation before training)."""
    detector = NoLearningDetector(steps_in_a_row, temperature, log=False)
    for record in history:
        if record["step"] > 0:
            detector.observe(record["step"], record)
    return detector.findings()


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _number(metrics: dict[str, float | None], key: str) -> float | None:
    """The metric, or None when absent or not finite (metrics.jsonl writes NaN as null)."""
    value = metrics.get(key)
    return None if value is None or not math.isfinite(value) else float(value)
