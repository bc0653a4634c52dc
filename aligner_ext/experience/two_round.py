"""TwoRoundSampling (MTPO): G answers per prompt, then H confidence continuations of each answer.

One step, with G = num_answer_generations and H = num_confidence_generations:

    round 1  every prompt draw is sampled G times; a sequence stops at `answer_stop_str` (kept)
             or after `max_answer_length` tokens: `<think>...</think><answer>...</answer>`
    round 2  every answer closed by the stop string is continued H times from the draw's prompt
             ids + the answer's exact round-1 ids (never re-tokenised text); a continuation stops
             at `confidence_stop_str` (kept) or after `max_confidence_length` tokens:
             `<analysis>...</analysis><confidence>c</confidence>`
    sample   round-1 ids + round-2 ids; G * H samples per prompt in (draw, answer, copy) order,
             `group_ids` = the draw, `answer_group_ids` = draw_id * G + answer index,
             `segment_ids` 0 on round-1 tokens and 1 on round-2 tokens

Rewards are scored by segment (rewards/calibration.py): the answer once per answer through the
row's reward function (RewardManager), the confidence once per continuation; the advantages are
`algorithms/mtpo.py`'s. Validation (`evaluate`) runs the same two rounds greedily, one answer and
one confidence per prompt, and reports calibration (experience/calibration_metrics.py).

Decisions (docs/variants/mtpo.md; tests/unit/experience/test_mtpo_two_round.py pins them):
- `apply_answer_loss_on_first_confidence_only` (default on): the round-1 tokens of an answer stay
  in `response_mask` only in its first copy, so they are trained once, not H times, and the
  masked copies count in no loss denominator (GlobalCounts are taken over `response_mask`).
- An answer that did not close (finish "eos" or "length") gets no round 2: its H samples hold the
  round-1 tokens alone (trained once, by the rule above) and every reward term is 0.
- `rollout.n` is the original recipe's `num_generations` = G * H (samples per prompt); the maker checks it
  so other components that read `rollout.n` (e.g. dynamic sampling) see the true group size.
- No EOS is appended after the confidence stop string: the samples hold what the engine
  sampled, as in single-round GRPO with `rollout.stop`.
- Round 1 and round 2 are seeded by (seed, step, round), so a resumed run repeats both rounds.
- Round 2 sends each prompt + answer H times; with `generator.hf.reuse_prompt_prefill` the HF
  engine prefills it once and copies its KV cache; the rollout engine does the same and, from its
  kept cache (`generator.rollout.prefix_cache`), copies round 1's K/V of prompt + answer instead of
  prefilling them again. `timing/mtpo_round{1,2}_s` and
  `mtpo/round2_time_ratio` measure both rounds every step.
- Generation ahead with partial rollouts (docs/async.md): either round's engine call may park at a
  refit and resume under the new weights (generation/resumable.py); each token keeps the version and
  log-prob of the weights that sampled it, round 1's and round 2's joined per sample (`_joined`).
  Round 2's prompt holds round 1's tokens, prefilled under whatever weights round 2 runs on, which is
  right: they are its context, not its samples, so each round-2 token's behaviour log-prob is that of
  the weights that sampled it given the exact tokens before it (as for a resumed response); a kept
  cache computed under older weights is never reused (`weights_fingerprint`). Both rounds' stop
  strings are their calls' `stop`, so one that straddles a park is matched there too
  (tests/unit/experience/test_mtpo_two_round.py, `test_rounds_parked_at_a_refit_*`). The round
  timings then include the wait for the refit.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

import torch

from aligner_ext.batch import ANSWER_SEGMENT, ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.data.loader import PromptLoader
from aligner_ext.data.types import PromptDraw
from aligner_ext.errors import ConfigError
from aligner_ext.experience.base import EXPERIENCE_MAKERS, GroupSampling, SampleRequest, identical_samples
from aligner_ext.experience.calibration_metrics import calibration_metrics
from aligner_ext.experience.settings import RolloutConfig, TwoRoundConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.groups import first_rows
from aligner_ext.rewards.calibration import SegmentRewards, SegmentScore
from aligner_ext.rewards.manager import RewardManager

_CLOSED_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)  # what a valid answer holds


@dataclass
class TwoRoundSample:
    """One sample: a prompt draw, one of its round-1 answers, and one round-2 continuation of it."""

    draw: PromptDraw
    answer_id: int  # unique per (draw, answer): draw_id * G + answer index
    copy: int  # index among the H continuations of the answer
    answer: GenerationOutput  # round 1
    confidence: GenerationOutput | None  # round 2; None when the answer did not close (no round 2)


@dataclass
class ScoredSample:
    """What scoring found for one sample."""

    segments: SegmentScore
    correct: float  # 1 / 0 (0 for an invalid answer)
    info: dict  # logged in SampleInfo.reward_info


@EXPERIENCE_MAKERS.register("two_round", "mtpo")
class TwoRoundSampling(GroupSampling):
    """MTPO rollouts: round 1 answers, round 2 confidences (see the module docstring)."""

    Config = TwoRoundConfig  # its settings (aligner_ext/experience/settings.py)

    summary_metrics = ("mtpo/valid_answer_ratio", "mtpo/round2_time_ratio")
    own_evaluation = "it evaluates two greedy rounds, one answer and one confidence per prompt"
    writes = (*GroupSampling.writes, "answer_group_ids", "segment_ids", "answer_rewards", "confidence_rewards")

    def __init__(self, mtpo: Config, rollout: RolloutConfig, engine: GenerationEngine, rewards: RewardManager,
                 tokenizer, seed: int = 0, return_routing: bool = False):
        super().__init__(rollout, engine, rewards, tokenizer, seed, return_routing)
        for name in ("num_answer_generations", "num_confidence_generations", "max_answer_length",
                     "max_confidence_length"):
            if getattr(mtpo, name) < 1:
                raise ValueError(f"mtpo.{name} must be >= 1, got {getattr(mtpo, name)}")
        for name in ("answer_stop_str", "confidence_stop_str"):
            if not getattr(mtpo, name):
                raise ValueError(f"mtpo.{name} must be a non-empty string")
        samples_per_prompt = mtpo.num_answer_generations * mtpo.num_confidence_generations
        if rollout.n != samples_per_prompt:
            raise ValueError(f"rollout.n ({rollout.n}) must equal mtpo.num_answer_generations x "
                             f"mtpo.num_confidence_generations = {samples_per_prompt} (samples per prompt)")
        self.mtpo = mtpo
        self.segment_rewards = SegmentRewards(mtpo.rewards)

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "TwoRoundSampling":
        return cls(ctx.cfg.mtpo, ctx.cfg.rollout, ctx.engine, ctx.rewards, ctx.tokenizer, seed=ctx.cfg.trainer.seed,
                   return_routing=ctx.policy.reads_routing)

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        draws = loader.next_batch()
        g, h = self.mtpo.num_answer_generations, self.mtpo.num_confidence_generations
        samples, timing = self.two_rounds(draws, g, h, *self.round_params(step))
        scored = self.score_samples(samples)
        batch = self.assemble_samples(samples, scored)
        metrics = {**self.rewards.metrics(), **identical_samples(batch)}
        metrics.update(rollout_metrics(samples, scored, batch))
        metrics.update(timing)
        return batch, metrics

    def round_params(self, step: int | None) -> tuple[SamplingParams, SamplingParams]:
        """Sampling of both rounds; step None means greedy (validation). Seeds differ by round."""
        base = None if step is None else self.sampling_params(step)
        rounds = []
        for index, (length, stop) in enumerate(((self.mtpo.max_answer_length, self.mtpo.answer_stop_str),
                                               (self.mtpo.max_confidence_length, self.mtpo.confidence_stop_str))):
            if base is None:
                rounds.append(SamplingParams(max_new_tokens=length, temperature=0.0, stop=[stop]))
            else:
                rounds.append(SamplingParams(max_new_tokens=length, temperature=base.temperature, top_p=base.top_p,
                                             stop=[stop], return_logprobs=base.return_logprobs,
                                             seed=2 * base.seed + index, ignore_eos=base.ignore_eos,
                                             return_routing=base.return_routing))
        return rounds[0], rounds[1]

    def two_rounds(self, draws: list[PromptDraw], g: int, h: int, answer_params: SamplingParams,
                   confidence_params: SamplingParams) -> tuple[list[TwoRoundSample], dict[str, float]]:
        """G answers per draw, then H continuations of each closed answer; samples in (draw, answer, copy) order."""
        started = time.perf_counter()
        answers = self.engine.generate([draw.prompt_ids for draw in draws for _ in range(g)], answer_params)
        round1 = time.perf_counter() - started
        closed = [i for i, answer in enumerate(answers) if answer.finish_reason == "stop"]
        prompts = [draws[i // g].prompt_ids + answers[i].token_ids for i in closed for _ in range(h)]
        started = time.perf_counter()
        continuations = iter(self.engine.generate(prompts, confidence_params) if prompts else [])
        round2 = time.perf_counter() - started
        samples = []
        for i, answer in enumerate(answers):
            draw = draws[i // g]
            for copy in range(h):
                confidence = next(continuations) if answer.finish_reason == "stop" else None
                samples.append(TwoRoundSample(draw, draw.draw_id * g + i % g, copy, answer, confidence))
        timing = {"timing/mtpo_round1_s": round1, "timing/mtpo_round2_s": round2,
                  "mtpo/round2_time_ratio": round2 / max(round1, 1e-9)}
        return samples, timing

    def score_samples(self, samples: list[TwoRoundSample]) -> list[ScoredSample]:
        """Answer rewards once per closed answer (reward registry), confidence rewards per sample."""
        closed = {s.answer_id: s for s in samples if s.confidence is not None}  # one sample per closed answer
        texts = {answer_id: self._decode(s.answer.token_ids) for answer_id, s in closed.items()}
        rows = [s.draw.row for s in closed.values()]
        results = dict(zip(closed, self.rewards.score(list(texts.values()), rows)))
        for answer_id, result in results.items():
            if result.correct is None:
                row = closed[answer_id].draw.row
                raise ConfigError(f"MTPO needs correctness from the reward of data_source {row.data_source!r} "
                                  f"(row {row.row_id}), which reports none; use a reward such as squad_exact_match")
        scored = []
        for s in samples:
            result = results.get(s.answer_id)
            answer_text = texts.get(s.answer_id) or self._decode(s.answer.token_ids)
            confidence_text = None if s.confidence is None else self._decode(s.confidence.token_ids)
            correct = 0.0 if result is None else float(result.correct)
            segments = self.segment_rewards.score(s.draw.row, answer_text, None if result is None else result.score,
                                                  correct, confidence_text)
            info = {"answer_text": answer_text, "confidence_text": confidence_text, "confidence": segments.confidence,
                    "answer_reward": segments.answer_reward, "confidence_reward": segments.confidence_reward,
                    "answer_finish": s.answer.finish_reason,
                    "confidence_finish": None if s.confidence is None else s.confidence.finish_reason,
                    **({} if result is None else result.info)}
            scored.append(ScoredSample(segments, correct, info))
        return scored

    def assemble_samples(self, samples: list[TwoRoundSample], scored: list[ScoredSample]) -> ExperienceBatch:
        """The batch: round-1 + round-2 ids, segment and answer ids, masks and rewards."""
        requests = [SampleRequest(s.draw, s.draw.prompt_ids, s.draw.draw_id) for s in samples]
        batch = self.assemble(requests, [_joined(s) for s in samples])
        width = batch.response_ids.shape[1]
        answer_lengths = torch.tensor([len(s.answer.token_ids) for s in samples], dtype=torch.long)
        batch.segment_ids = (torch.arange(width)[None, :] >= answer_lengths[:, None]).long()
        batch.answer_group_ids = torch.tensor([s.answer_id for s in samples], dtype=torch.long)
        if self.mtpo.apply_answer_loss_on_first_confidence_only:
            later_copy = torch.tensor([s.copy > 0 for s in samples])
            batch.response_mask &= ~((batch.segment_ids == ANSWER_SEGMENT) & later_copy[:, None])
        for sample, scoring in zip(batch.samples, scored):
            sample.reward_info = scoring.info
        batch.answer_rewards = torch.tensor([x.segments.answer_reward for x in scored], dtype=torch.float32)
        batch.confidence_rewards = torch.tensor([x.segments.confidence_reward for x in scored], dtype=torch.float32)
        batch.rewards = batch.answer_rewards + batch.confidence_rewards
        batch.correct = torch.tensor([x.correct for x in scored], dtype=torch.float32)
        batch.token_rewards = segment_token_rewards(batch.answer_rewards, batch.confidence_rewards, answer_lengths,
                                                    batch.response_lengths, width)
        return batch

    def evaluate(self, loader: PromptLoader,
                 single_round: Callable[[PromptLoader], dict[str, float]]) -> dict[str, float]:
        """Greedy two rounds, one answer and one confidence per prompt; accuracy and calibration.
        Sampled evaluation (trainer.eval.k > 1) is refused at load (`own_evaluation`).

        A missing or unparseable confidence counts as 0 (RLCR's evaluation); how often that
        happened is `val/confidence_parsed_ratio`. With no confidence stated at all, calibration is
        undefined: Brier, ECE, AUROC and mean confidence are NaN (experience/calibration_metrics.py).
        """
        answer_params, confidence_params = self.round_params(None)
        samples = []
        for draws in loader.iterate_once():
            samples.extend(self.two_rounds(draws, 1, 1, answer_params, confidence_params)[0])
        scored = self.score_samples(samples)
        confidence = torch.tensor([x.segments.confidence or 0.0 for x in scored], dtype=torch.float64)
        correct = torch.tensor([x.correct for x in scored], dtype=torch.float64)
        stated = torch.tensor([x.segments.confidence is not None for x in scored], dtype=torch.bool)
        metrics = calibration_metrics(confidence, correct, "val/", stated=stated)
        metrics.update({
            "val/reward_mean": _mean([x.segments.answer_reward + x.segments.confidence_reward for x in scored]),
            "val/valid_answer_ratio": _mean([_CLOSED_ANSWER.search(x.info["answer_text"]) is not None for x in scored]),
        "val/answer_stop_found_ratio": _mean([s.confidence is not None for s in samples]),
            "val/confidence_parsed_ratio": _mean([x.segments.confidence is not None for x in scored]),
            "val/answer_length": _mean([len(s.answer.token_ids) for s in samples]),
            "val/confidence_length": _mean([len(s.confidence.token_ids) for s in samples if s.confidence]),
            "val/num_prompts": float(len(samples)),
        })
        return metrics

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _joined(sample: TwoRoundSample) -> GenerationOutput:
    """Round-1 + round-2 ids as one output; the finish reason of the last round that ran; each token's
    log-prob and version (partial rollouts) those of the round that sampled it. Its routing: round 1's
    over the prompt and the answer (the experts its tokens were sampled under), round 2's from the
    answer's last token on (which round 1 never fed back; round 2 fed it as part of its prompt)."""
    answer, confidence = sample.answer, sample.confidence
    last = confidence or answer
    ids = answer.token_ids + (confidence.token_ids if confidence else [])
    logprobs = _both_rounds(answer.logprobs, confidence and confidence.logprobs)
    versions = _both_rounds(answer.versions, confidence and confidence.versions)
    routing = answer.routing
    if routing is not None and confidence is not None:
        routing = torch.cat([routing[:-1], confidence.routing[len(routing) - 1 :]])
    return GenerationOutput(token_ids=ids, finish_reason=last.finish_reason, logprobs=logprobs, routing=routing,
                            versions=versions)


def _both_rounds(answer: list | None, confidence: list | None) -> list | None:
    """A per-token list of round 1 followed by round 2's (none without round 2); None if round 1 has none."""
    return None if answer is None else answer + (confidence or [])


def segment_token_rewards(answer_rewards: torch.Tensor, confidence_rewards: torch.Tensor, answer_lengths: torch.Tensor,
                          lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width]: R_ans on the last round-1 token, R_conf on the last round-2 token (if any), 0 elsewhere."""
    token_rewards = torch.zeros(len(lengths), width, dtype=torch.float32)
    rows = torch.arange(len(lengths))
    has_answer = answer_lengths > 0
    token_rewards[rows[has_answer], answer_lengths[has_answer] - 1] += answer_rewards[has_answer]
    has_round2 = lengths > answer_lengths
    token_rewards[rows[has_round2], lengths[has_round2] - 1] += confidence_rewards[has_round2]
    return token_rewards


def rollout_metrics(samples: list[TwoRoundSample], scored: list[ScoredSample],
                    batch: ExperienceBatch) -> dict[str, float]:
    """Round shapes, reward parts and training-batch calibration of one step."""
    firsts = [(s, x) for s, x in zip(samples, scored) if s.copy == 0]  # one per answer
    continued = [(s, x) for s, x in zip(samples, scored) if s.confidence is not None]
    group_std = _group_std(batch.answer_rewards, batch.group_ids, batch.answer_group_ids)
    metrics = {
        "mtpo/valid_answer_ratio": _mean([_CLOSED_ANSWER.search(x.info["answer_text"]) is not None for _, x in firsts]),
        "mtpo/answer_stop_found_ratio": _mean([s.answer.finish_reason == "stop" for s, _ in firsts]),
        "mtpo/answer_format_ratio": _mean([x.segments.answer_format for _, x in firsts]),
        "mtpo/answer_length_mean": _mean([len(s.answer.token_ids) for s, _ in firsts]),
        "mtpo/answer_reward_mean": _mean([x.segments.answer_reward for _, x in firsts]),
        "mtpo/answer_reward_group_std": group_std,
        "mtpo/confidence_stop_found_ratio": _mean([s.confidence.finish_reason == "stop" for s, _ in continued]),
        "mtpo/confidence_parsed_ratio": _mean([x.segments.confidence is not None for _, x in continued]),
        "mtpo/confidence_format_ratio": _mean([x.segments.confidence_format for _, x in continued]),
        "mtpo/confidence_length_mean": _mean([len(s.confidence.token_ids) for s, _ in continued]),
        "mtpo/confidence_reward_mean": _mean([x.segments.confidence_reward for _, x in continued]),
        "mtpo/confidence_reward_group_std": _group_std(batch.confidence_rewards, batch.answer_group_ids, None),
    }
    if continued:
        confidence = torch.tensor([x.segments.confidence or 0.0 for _, x in continued], dtype=torch.float64)
        correct = torch.tensor([x.correct for _, x in continued], dtype=torch.float64)
        stated = torch.tensor([x.segments.confidence is not None for _, x in continued], dtype=torch.bool)
        metrics.update(calibration_metrics(confidence, correct, "mtpo/train_", stated=stated))
    return metrics


def _group_std(values: torch.Tensor, group_ids: torch.Tensor, answer_group_ids: torch.Tensor | None) -> float:
    """Mean over groups of the population std of `values` within each group (one value per answer if given)."""
    if answer_group_ids is not None:
        _, first = first_rows(answer_group_ids)
        values, group_ids = values[first], group_ids[first]
    stds = [values[group_ids == g].double().std(unbiased=False) for g in group_ids.unique()]
    return float(torch.stack(stds).mean()) if stds else float("nan")


def _mean(values: list) -> float:
    return float(sum(values) / len(values)) if values else float("nan")
