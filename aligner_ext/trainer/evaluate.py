"""Held-out evaluation: k responses to each validation prompt, scored by the reward registry.

The default (trainer.eval: k = 1 at temperature 0) is greedy accuracy. Each engine call covers one
batch of `data.val_batch_size` prompts, each repeated k times, so the samples of a prompt are
generated in the same call as the rest of its batch. Per validation set, over its prompts:

    accuracy         mean correctness over every response (greedy accuracy at k = 1)
    reward_mean      mean reward over every response
    response_length  mean response tokens; num_prompts: the prompts evaluated
    mean_at_k        mean over prompts of the share of their k responses that are correct
    pass_at_j        unbiased pass@j (Chen et al. 2021, "Evaluating Large Language Models Trained on
                     Code", eq. 1): a prompt with n responses, c of them correct, has
                     pass@j = 1 - C(n - c, j) / C(n, j); the mean over prompts
    maj_at_k         whether the answer most of a prompt's k responses give is correct; the mean

the last three only at k > 1. With more than one data_source in a set, `<data_source>/accuracy`,
`<data_source>/reward_mean` and the k > 1 metrics of each too. Keys start `val/`; with several
validation sets (data.val_sets), `val/<set>/`, and the bare `val/` keys pool the sets (below).

Decisions (tests/unit/trainer/test_sampled_evaluation.py pins them; docs/evaluation.md):
- pass@j is computed on exact integers as (C(n, j) - C(n - c, j)) / C(n, j), rounded once: float
  binomials overflow past n ~ 1030, and 1 - ratio loses digits when pass@j is small.
- pass@j is reported for j = 1, 2, 4, ... below k, and k (trainer.eval.pass_at chooses others). pass@1
  and mean@k are the same estimate (c / n, averaged), and equal accuracy when every reward reports
  correctness.
- A response is correct when its reward reports correct > 0.5 (rewards report 1 or 0). A response
  whose reward reports no correctness is left out of n; a prompt with fewer than j such responses
  has no pass@j (left out of the mean).
- maj@k votes by the answer the reward extracted (`RewardResult.answer`, rewards/base.py). A
  response without an answer does not vote; a prompt where none has one counts as wrong. A tie
  counts as the expected outcome of breaking it uniformly at random: the mean correctness of the
  tied answers (each answer as correct as the mean of its responses). A data_source whose reward
  extracts no answer has no maj@k (the start-up log names it), nor has a set holding one.
- Keys spell `@` as `_at_`: MLflow refuses `@` in a metric name.
- Several sets: each is evaluated as if alone, keyed `val/<set>/...`; the bare `val/<metric>` of a
  metric that is a mean over responses or prompts (POOLED) is the mean over the sets weighted by
  their prompts, skipping a set where it is undefined (the sets' value concatenated, up to responses
  without correctness); `val/num_prompts` is their sum. So the summary, the plot and the progress bar
  read the same keys whatever the number of sets.
- The sampling is seeded by (trainer.seed, step, set, call), so a resumed run evaluates as the first would.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

import numpy as np

from aligner_ext.config import RunConfig
from aligner_ext.data.loader import PromptLoader
from aligner_ext.distributed import is_main_process
from aligner_ext.generation.base import GenerationEngine, SamplingParams
from aligner_ext.rewards.manager import RewardManager
from aligner_ext.trainer.build import Components

logger = logging.getLogger(__name__)

POOLED = re.compile(r"val/(accuracy|reward_mean|response_length|(mean|pass|maj)_at_\d+)")


@dataclass
class PromptResponses:
    """The k responses to one validation prompt, as scored."""

    source: str  # the row's data_source
    scores: list[float]
    correct: list[float]  # NaN where the reward reports no correctness
    lengths: list[int]  # response tokens
    answers: list[str | None] | None  # the extracted answers (None where none was found); None: not voted on


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n responses of which c are correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021),
    on exact integers, rounded once."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def prompt_pass_at(correct: list[float], k: int) -> float:
    """pass@k of one prompt's responses; NaN when fewer than k report correctness."""
    judged = [value for value in correct if not math.isnan(value)]
    if len(judged) < k:
        return math.nan
    return pass_at_k(len(judged), sum(value > 0.5 for value in judged), k)


def majority_correct(answers: list[str | None], correct: list[float]) -> float:
    """maj@k of one prompt: the correctness of the answer most responses give. Responses without an
    answer do not vote (none answered: 0.0); a tie gives the mean correctness of the tied answers."""
    votes: dict[str, list[float]] = {}
    for answer, value in zip(answers, correct):
        if answer is not None:
            votes.setdefault(answer, []).append(value)
    if not votes:
        return 0.0
    most = max(len(values) for values in votes.values())
    return nanmean([nanmean(values) for values in votes.values() if len(values) == most])


def default_pass_at(k: int) -> list[int]:
    """1, 2, 4, ... below k, and k."""
    return [2**power for power in range(k.bit_length()) if 2**power < k] + [k]


def nanmean(values) -> float:
    """The float64 mean of the values that are not NaN; NaN when there are none."""
    kept = [value for value in values if not math.isnan(value)]
    return math.fsum(kept) / len(kept) if kept else math.nan


def group_metrics(prompts: list[PromptResponses], k: int, pass_at: Sequence[int]) -> dict[str, float]:
    """Accuracy and mean reward of some prompts; at k > 1 also mean@k, pass@j and, when every prompt's
    answers are voted on, maj@k (keys without a prefix)."""
    metrics = {"accuracy": nanmean(value for prompt in prompts for value in prompt.correct),
               "reward_mean": nanmean(score for prompt in prompts for score in prompt.scores)}
    if k == 1:
        return metrics
    metrics[f"mean_at_{k}"] = nanmean(nanmean(prompt.correct) for prompt in prompts)
    for j in pass_at:
        metrics[f"pass_at_{j}"] = nanmean(prompt_pass_at(prompt.correct, j) for prompt in prompts)
    if all(prompt.answers is not None for prompt in prompts):
        metrics[f"maj_at_{k}"] = nanmean(majority_correct(prompt.answers, prompt.correct) for prompt in prompts)
    return metrics


def set_metrics(prompts: list[PromptResponses], k: int, pass_at: Sequence[int]) -> dict[str, float]:
    """The `val/` metrics of one validation set (module docstring)."""
    metrics = {f"val/{name}": value for name, value in group_metrics(prompts, k, pass_at).items()}
    metrics["val/response_length"] = nanmean(length for prompt in prompts for length in prompt.lengths)
    metrics["val/num_prompts"] = float(len(prompts))
    sources = sorted({prompt.source for prompt in prompts})
    if len(sources) > 1:
        for source in sources:
            mine = [prompt for prompt in prompts if prompt.source == source]
            metrics.update({f"val/{source}/{name}": value for name, value in group_metrics(mine, k, pass_at).items()})
    return metrics


def evaluate(engine: GenerationEngine, rewards: RewardManager, tokenizer, loader: PromptLoader,
             params: SamplingParams, k: int = 1, pass_at: Sequence[int] = ()) -> dict[str, float]:
    """The metrics of one validation set: `k` responses per prompt drawn with `params`, one engine call
    per batch of `loader` (each call seeded from `params.seed` and its index); `pass_at`: the j of each
    pass@j (empty: `default_pass_at(k)`)."""
    prompts = []
    for call, draws in enumerate(loader.iterate_once()):
        seeded = replace(params, seed=None if params.seed is None else derived_seed(params.seed, call))
        outputs = engine.generate([draw.prompt_ids for draw in draws for _ in range(k)], seeded)
        texts = [tokenizer.decode(output.token_ids, skip_special_tokens=True) for output in outputs]
        results = rewards.score(texts, [draw.row for draw in draws for _ in range(k)])
        for index, draw in enumerate(draws):
            mine, responses = results[index * k:(index + 1) * k], outputs[index * k:(index + 1) * k]
            voted = k > 1 and rewards.extracts_answer(draw.row)
            prompts.append(PromptResponses(
                source=draw.row.data_source, scores=[result.score for result in mine],
                correct=[math.nan if result.correct is None else result.correct for result in mine],
                lengths=[len(output.token_ids) for output in responses],
                answers=[result.answer for result in mine] if voted else None))
    return set_metrics(prompts, k, pass_at or default_pass_at(k))


def derived_seed(*key: int) -> int:
    """A seed drawn from the non-negative integers `key`: different keys give independent streams."""
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0])


def pooled(per_set: dict[str, dict[str, float]]) -> dict[str, float]:
    """The bare `val/` metrics over several sets (module docstring): each POOLED metric every set reports,
    weighted by the sets' prompts; `val/num_prompts` their sum."""
    weights = {name: metrics.get("val/num_prompts", 0.0) for name, metrics in per_set.items()}
    combined = {"val/num_prompts": sum(weights.values())}
    shared = set.intersection(*(set(metrics) for metrics in per_set.values()))
    for key in sorted(key for key in shared if POOLED.fullmatch(key)):
        pairs = [(weights[name], metrics[key]) for name, metrics in per_set.items() if not math.isnan(metrics[key])]
        total = sum(weight for weight, _ in pairs)
        combined[key] = math.fsum(weight * value for weight, value in pairs) / total if total else math.nan
    return combined


def combined_metrics(per_set: dict[str, dict[str, float]]) -> dict[str, float]:
    """One set's metrics as they are; several sets' keyed `val/<set>/...`, with their pooled `val/...`."""
    if len(per_set) <= 1:
        return next(iter(per_set.values()), {})
    metrics = {key.replace("val/", f"val/{name}/", 1): value
               for name, set_values in per_set.items() for key, value in set_values.items()}
    metrics.update(pooled(per_set))
    return metrics


class Evaluator:
    """A run's held-out evaluation (trainer.eval): when it is due, and the metrics of every validation set."""

    def __init__(self, cfg: RunConfig, parts: Components):
        self.settings = cfg.trainer.eval
        self.total_steps = cfg.trainer.total_steps
        self.seed = cfg.trainer.seed
        self.params = SamplingParams(max_new_tokens=cfg.rollout.max_response_length,
                                     temperature=self.settings.temperature, top_p=self.settings.top_p,
                                     stop=list(cfg.rollout.stop))
        self.parts = parts

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` updates: after the last, and every `trainer.eval.every` (the
        evaluation before training, step 0, is the loop's own call)."""
        every = self.settings.every
        return step == self.total_steps or (every > 0 and step % every == 0)

    def __call__(self, step: int) -> dict[str, float]:
        """The metrics of every validation set at `step` ({} without one), and a log line of their headline."""
        per_set = {}
        for index, (name, loader) in enumerate(self.parts.val_loaders.items()):
            params = replace(self.params, seed=derived_seed(self.seed, step, index))
            per_set[name] = self.parts.maker.evaluate(loader, partial(self.single_round, params=params))
        metrics = combined_metrics(per_set)
        if "val/accuracy" in metrics and is_main_process():
            logger.info("step %d: %s", step, self.headline(metrics, per_set))
        return metrics

    def single_round(self, loader: PromptLoader, params: SamplingParams) -> dict[str, float]:
        """One set's single-round evaluation, what an experience maker's `evaluate` runs by default."""
        return evaluate(self.parts.engine, self.parts.rewards, self.parts.tokenizer, loader, params,
                        self.settings.k, self.settings.pass_at)

    def headline(self, metrics: dict[str, float], per_set: dict[str, dict[str, float]]) -> str:
        """Accuracy (of each set too, when there are several), pass@k and maj@k if reported, mean reward."""
        accuracy = f"held-out accuracy {100 * metrics['val/accuracy']:.1f}%"
        if len(per_set) > 1:
            accuracy += " (" + ", ".join(f"{name} {100 * values.get('val/accuracy', math.nan):.1f}%"
                                         for name, values in per_set.items()) + ")"
        parts = [accuracy]
        k = self.settings.k
        for name, key in ((f"pass@{k}", f"val/pass_at_{k}"), (f"maj@{k}", f"val/maj_at_{k}")):
            if key in metrics:
                parts.append(f"{name} {100 * metrics[key]:.1f}%")
        parts.append(f"mean reward {metrics.get('val/reward_mean', math.nan):.3f}")
        return ", ".join(parts)
