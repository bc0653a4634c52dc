"""Experience makers: how one step's rollouts are produced, scored and grouped.

`GroupSampling` is plain GRPO: draw `data.train_batch_size` prompts, sample `rollout.n` responses
for each, score them with the reward registry, and give every sample of one prompt draw the same
group id. Variants override one of its named steps instead of copying the flow:

- `requests(draws)`: what the generator sees for each sample (graded system prompt changes it);
- `generate(requests)`: how responses are produced (two-round rollouts change it);
- `score(batch)`: how responses become rewards;
- `evaluate(loader, single_round)` (on every maker): held-out metrics; the default is the run's
  single-round evaluation (trainer/evaluate.py: greedy, or k samples per prompt); two-round rollouts
  evaluate both rounds, and say so in `own_evaluation`;
- `rows_scored_by_rewards(cfg, rows)` (a class method): the rows the reward registry scores, checked
  for a reward function before the model loads (agent episodes leave out those their environment scores);
- `warmup_examples(cfg, rows)` (a class method): the (messages, target) pairs the embedded model's
  supervised warm-up trains on; the default is each row's prompt and gold solution (the graded
  system prompt also shows its system messages, so the tiny model learns to read them).

The training prompt is always the draw's own prompt tokens, whatever the generator saw.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo, routing_fields
from aligner_ext.context import BuildContext
from aligner_ext.data.loader import PromptLoader
from aligner_ext.data.tasks import sft_target
from aligner_ext.data.templating import left_pad, right_pad
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.errors import ConfigError
from aligner_ext.experience.carry_over import CarryOver
from aligner_ext.experience.settings import RolloutConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.groups import identical_group_fraction
from aligner_ext.registry import Registry
from aligner_ext.rewards.manager import RewardManager

logger = logging.getLogger(__name__)
EXPERIENCE_MAKERS = Registry("experience maker")
EXPERIENCE_WRAPPERS = Registry("experience wrapper")  # take the inner maker, add one behaviour


@dataclass
class SampleRequest:
    """One sample to generate: the draw it belongs to and the prompt the generator sees."""

    draw: PromptDraw
    generation_prompt: list[int]  # token ids given to the engine (may differ from draw.prompt_ids)
    group_id: int  # the GRPO group (the prompt draw), set explicitly


class ExperienceMaker(abc.ABC):
    """Produces one step's scored rollouts from the prompt stream.

    A registered maker also has `from_context(ctx)`; a registered wrapper `from_context(inner, ctx)`
    (see aligner_ext/context.py). `reads` and `writes` are its batch contract (trainer/contracts.py).
    """

    summary_metrics: tuple[str, ...] = ()  # metrics whose run mean the end-of-run summary shows
    own_evaluation: str | None = None  # how `evaluate` departs from the single-round evaluation, whose sampling settings (trainer.eval) the config's load then refuses (from the generated table aligner_ext/plugin_names.py; a maker of a dotted path when the run builds); None: it runs that one
    reads: tuple[str, ...] = ()  # ExperienceBatch fields it needs from the inner maker (wrappers), checked at build
    writes: tuple[str, ...] = ()  # optional ExperienceBatch fields every batch it returns has set

    @abc.abstractmethod
    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        """Return the step's batch (rewards set, log-probs and advantages not yet) and its metrics."""

    def evaluate(self, loader: PromptLoader,
                 single_round: Callable[[PromptLoader], dict[str, float]]) -> dict[str, float]:
        """Override point: held-out metrics over one pass of `loader`.

        `single_round` is the run's evaluation of one response round (trainer/evaluate.py), the
        default. A maker whose samples take another shape (two-round rollouts) evaluates its own way
        and names it in `own_evaluation`; a wrapper forwards to its inner maker.
        """
        return single_round(loader)

    @classmethod
    def warmup_examples(cls, cfg, rows: list[PromptRow]) -> list[tuple[list[dict[str, str]], str]]:
        """(messages, target) pairs for the embedded model's supervised warm-up on built-in `rows`.

        `cfg` is the RunConfig. The default teaches each row's gold solution on its own prompt; a
        maker whose generator sees other prompts than the rows' overrides this to show them.
        """
        return [(row.messages, sft_target(row)) for row in rows]

    @classmethod
    def rows_scored_by_rewards(cls, cfg, rows: list[PromptRow]) -> list[PromptRow]:
        """The rows whose responses the reward registry scores, whose reward functions the build checks
        before the model loads (`cfg` is the RunConfig); every row by default, fewer for a maker whose
        environments score their own episodes."""
        return rows

    def check_rows(self, rows: list[PromptRow]) -> None:  # noqa: B027 - most makers take any row
        """Override point: raise a UserError (aligner_ext/errors.py) for a training row this maker would
        fail on when a step draws it (the build calls this before the first step); a wrapper checks
        its inner maker's too."""

    def state_dict(self) -> dict:
        """Anything a maker carries between steps (saved in checkpoints)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - stateless makers have nothing to load
        """Restore what `state_dict` returned."""


class ExperienceWrapper(ExperienceMaker):
    """A maker around another: by default everything but `make_experience` goes to the inner maker."""

    def __init__(self, inner: ExperienceMaker):
        self.inner = inner
        self.summary_metrics = inner.summary_metrics

    def evaluate(self, loader: PromptLoader,
                 single_round: Callable[[PromptLoader], dict[str, float]]) -> dict[str, float]:
        return self.inner.evaluate(loader, single_round)

    @classmethod
    def wrap_warmup_examples(cls, cfg, rows: list[PromptRow], examples: list[tuple[list[dict[str, str]], str]],
                             reads: frozenset[str]) -> list[tuple[list[dict[str, str]], str]]:
        """Override point: the embedded model's warm-up pairs (`examples`, the inner maker's) with what this
        wrapper's stage needs the model to have seen (`reads`: the batch fields the run's advantage and loss
        read); unchanged by default."""
        return examples

    def check_rows(self, rows: list[PromptRow]) -> None:
        self.inner.check_rows(rows)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])


@EXPERIENCE_MAKERS.register("group_sampling", "grpo")
class GroupSampling(ExperienceMaker):
    """GRPO: `n` samples per prompt draw, one group each."""

    Config = RolloutConfig
    writes = ("rewards", "correct", "token_rewards", "generation_logprobs", "generation_versions")

    def __init__(self, cfg: RolloutConfig, engine: GenerationEngine, rewards: RewardManager, tokenizer,
                 seed: int = 0, return_routing: bool = False):
        if cfg.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {cfg.n}")
        if not cfg.return_logprobs:
            self.writes = without(self.writes, "generation_logprobs")
        self.cfg = cfg
        self.engine = engine
        self.rewards = rewards
        self.tokenizer = tokenizer
        self.seed = seed
        self.return_routing = return_routing  # the policy reads the engine's experts (`Policy.reads_routing`)
        self.carry_over = None  # with rollout.carry_over.groups: the groups carried between steps
        if cfg.carry_over.groups:
            if not engine.reports_finished:
                raise ConfigError(f"rollout.carry_over.groups={cfg.carry_over.groups} needs the rollout engine in one "
                                  f"process, which reports each finished response; this run generates with "
                                  f"{type(engine).__name__}: set generator.engine=rollout, or rollout.carry_over.groups=0")
            self.carry_over = CarryOver(cfg.carry_over, engine, tokenizer)

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "GroupSampling":
        return cls(ctx.cfg.rollout, ctx.engine, ctx.rewards, ctx.tokenizer, seed=ctx.cfg.trainer.seed,
                   return_routing=ctx.policy.reads_routing)

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        params = self.sampling_params(step)
        if self.carry_over is None:
            requests = self.requests(loader.next_batch())
            outputs, carried = self.generate(requests, params), {}
        else:  # B whole groups, some begun at earlier steps (experience/carry_over.py)
            requests, outputs, carried = self.carry_over.generate(loader, params, self.requests)
        batch = self.assemble(requests, outputs)
        self.score(batch)
        return batch, {**self.rewards.metrics(), **identical_samples(batch), **carried}

    def state_dict(self) -> dict:
        return self.carry_over.state_dict() if self.carry_over is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """The carried groups, where this run carries groups over; a checkpoint's carried groups resumed by a run
        that does not are dropped, in one line (their prompts are past in the stream)."""
        carried = state.get("carried", [])
        if self.carry_over is not None:
            self.carry_over.load_state_dict({"carried": carried})
        elif carried:
            logger.warning("dropping the checkpoint's %d group(s) carried over to the next step: this run has "
                           "rollout.carry_over.groups=0, so their prompts are not trained", len(carried))

    def sampling_params(self, step: int) -> SamplingParams:
        """Training sampling; seeded by (seed, step) so a resumed run samples the same responses."""
        return SamplingParams(
            max_new_tokens=self.cfg.max_response_length, temperature=self.cfg.temperature,
            top_p=self.cfg.top_p, stop=list(self.cfg.stop), return_logprobs=self.cfg.return_logprobs,
            seed=self.seed * 1_000_003 + step, ignore_eos=self.cfg.ignore_eos, return_routing=self.return_routing,
        )

    def requests(self, draws: list[PromptDraw]) -> list[SampleRequest]:
        """Override point: `n` identical requests per draw, grouped by the draw id."""
        return [SampleRequest(draw, draw.prompt_ids, draw.draw_id) for draw in draws for _ in range(self.cfg.n)]

    def generate(self, requests: list[SampleRequest], params: SamplingParams) -> list[GenerationOutput]:
        """Override point: one engine call over every request."""
        return self.engine.generate([request.generation_prompt for request in requests], params)

    def assemble(self, requests: list[SampleRequest], outputs: list[GenerationOutput]) -> ExperienceBatch:
        """Tensors of the batch: the draw's own prompt (not the generator's) and the generated ids; the
        engine's routing where it returned one, for the rows whose generator prompt is the trained one;
        the version of the weights that sampled them."""
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad([request.draw.prompt_ids for request in requests], pad)
        response_ids, response_valid = right_pad([output.token_ids for output in outputs], pad)
        prompt_routing = response_routing = None
        recorded = [output.routing for output in outputs if output.routing is not None]
        if recorded:
            routings = [output.routing if request.generation_prompt == request.draw.prompt_ids else None
                        for request, output in zip(requests, outputs)]
            prompt_routing, response_routing = routing_fields(
                routings, [len(request.draw.prompt_ids) for request in requests], prompt_ids.shape[1],
                response_ids.shape[1], recorded[0].shape[1:])
        samples = [
            SampleInfo(
                row=request.draw.row,
                response_text=self.tokenizer.decode(output.token_ids, skip_special_tokens=True),
                finish_reason=output.finish_reason,
            )
            for request, output in zip(requests, outputs)
        ]
        generation_logprobs = None
        if self.cfg.return_logprobs:
            generation_logprobs, _ = right_pad([output.logprobs or [] for output in outputs], 0.0, torch.float32)
        return ExperienceBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_valid=response_valid, response_mask=response_valid.clone(),
            group_ids=torch.tensor([request.group_id for request in requests], dtype=torch.long),
            samples=samples, generation_logprobs=generation_logprobs, prompt_routing=prompt_routing,
            response_routing=response_routing,
            generation_versions=sampled_versions(response_valid, self.engine, outputs),
        )

    def score(self, batch: ExperienceBatch) -> None:
        """Override point: sequence rewards, raw correctness, and the sparse token reward."""
        results = self.rewards.score([s.response_text for s in batch.samples], [s.row for s in batch.samples])
        for sample, result in zip(batch.samples, results):
            sample.reward_info = result.info
        batch.rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
        batch.correct = torch.tensor(
            [r.correct if r.correct is not None else float("nan") for r in results], dtype=torch.float32
        )
        batch.token_rewards = sparse_token_rewards(batch.rewards, batch.response_lengths, batch.response_ids.shape[1])


def sampled_versions(sampled: torch.Tensor, engine: GenerationEngine,
                     outputs: list[GenerationOutput] = ()) -> torch.Tensor:
    """[B, R] int64: the version of the weights that sampled each of the `sampled` tokens, 0 elsewhere:
    `engine.weights_version`, or per token where the engine's `outputs` say (partial rollouts set them on
    every output, generation/resumable.py)."""
    if not outputs or outputs[0].versions is None:
        return sampled.long() * engine.weights_version
    return right_pad([output.versions for output in outputs], 0, torch.long)[0] * sampled


def sparse_token_rewards(rewards: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] zeros with each reward on its sequence's last generated token (none if empty)."""
    token_rewards = torch.zeros(len(rewards), width, dtype=torch.float32)
    has_tokens = lengths > 0
    rows = torch.nonzero(has_tokens).squeeze(1)
    token_rewards[rows, lengths[has_tokens] - 1] = rewards[has_tokens]
    return token_rewards


def identical_samples(batch: ExperienceBatch) -> dict[str, float]:
    """`rollout/identical_group_fraction`: the share of groups whose samples are token-identical. With
    sampling, every group identical is sampling that does not vary (a server giving a whole request
    one seed) or a policy collapsed to one answer per prompt: no group then has a learning signal
    (trainer/no_learning.py warns). Measured before any filter drops groups; absent without a group
    of two samples."""
    tokens = batch.response_ids.masked_fill(~batch.response_valid, -1)  # padding never equals a token
    fraction = identical_group_fraction(tokens, batch.group_ids)
    return {} if fraction is None else {"rollout/identical_group_fraction": fraction}


def without(fields: tuple[str, ...], field: str) -> tuple[str, ...]:
    """`fields` less `field`: a maker that does not provide one of its class's `writes` (contract)."""
    return tuple(name for name in fields if name != field)
