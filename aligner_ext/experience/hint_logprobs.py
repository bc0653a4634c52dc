"""HintLogprobs: an experience wrapper that adds what CPO's advantage reads to the inner maker's batch.

After the inner maker returns its scored batch, one no-grad pass of the policy scores every
response under its prompt with the row's hint injected (`data/hints.py`), giving
`batch.hint_logprobs` [B, R] = log p(y_t | x, hint, y_<t) on the very same response tokens
(`batch.has_hint` marks the rows that got a hint). The plain log-probs and entropy come from the
loop's old-log-prob pass (`batch.old_logprobs`, `batch.entropy`), so no pass is run twice; the MI
metrics are therefore reported by the estimator (`algorithms/cpo.py`).

It reports per step the hint counts and lengths (`cpo/hint_*`). The hinted prompts are rendered row
by row by `data/hints.py`; here they are left-padded to their own width while the response ids and
masks stay the same tensors, so positions (`ExperienceBatch.position_ids`, counted over real tokens)
continue through the hint and shift every later prompt token by the hint's length.

It is listed in `algorithm.experience_wrappers` and turns itself on only when a later stage reads a
field it writes (`BuildContext.reads_after_experience`: the CPO estimator reads `hint_logprobs`);
otherwise it returns the inner maker untouched. Listed outside a filtering wrapper (dynamic
sampling), it runs on the kept groups only. With `cpo.hint.warmup_share` it also adds hinted prompts to
the embedded model's warm-up (`wrap_warmup_examples`), so that model learns to read a hint at all.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.data.hints import HintConfig, check_hints, hint_text, hinted_messages, hinted_prompt_ids
from aligner_ext.data.loader import PromptLoader
from aligner_ext.data.tasks import sft_target
from aligner_ext.data.templating import left_pad
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import EXPERIENCE_WRAPPERS, ExperienceMaker, ExperienceWrapper
from aligner_ext.models.base import Policy


@dataclass
class HintedPrompts:
    """Hinted prompt ids of a batch's rows, and what was skipped or cut."""

    prompt_ids: list[list[int] | None]  # [B] hinted prompt ids; None where the row has no hint (missing=skip)
    hint_tokens: list[int] = field(default_factory=list)  # tokens each hinted row gained over its original prompt
    num_missing: int = 0  # rows without a hint (skipped)
    num_truncated: int = 0  # rows whose hint was cut to max_hint_length


def hinted_prompts(batch: ExperienceBatch, tokenizer, cfg: HintConfig, gold_as_hint: bool) -> HintedPrompts:
    """Hinted prompt ids for every row of `batch`; rows of one prompt draw are rendered once."""
    result = HintedPrompts(prompt_ids=[])
    cache: dict[tuple[str, tuple[int, ...]], tuple[list[int] | None, bool]] = {}
    for i, sample in enumerate(batch.samples):
        original = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        key = (sample.row.row_id, tuple(original))
        if key not in cache:
            cache[key] = hinted_prompt_ids(sample.row, original, tokenizer, cfg, gold_as_hint)
        ids, truncated = cache[key]
        result.prompt_ids.append(ids)
        if ids is None:
            result.num_missing += 1
            continue
        result.hint_tokens.append(len(ids) - len(original))
        result.num_truncated += int(truncated)
    return result


def hinted_batch(batch: ExperienceBatch, prompt_ids: list[list[int]], pad_id: int) -> ExperienceBatch:
    """`batch` with its prompts replaced by `prompt_ids` (left-padded to their own width).

    Responses (ids, valid and loss masks) are the same tensors, so log-probs of the hinted batch are
    those of the very same response tokens; positions follow from the new prompt mask. The engine
    never ran the hinted sequences, so their routing is dropped: the trainer's routers choose.
    """
    if len(prompt_ids) != len(batch):
        raise ValueError(f"{len(prompt_ids)} hinted prompts for a batch of {len(batch)} rows")
    ids, mask = left_pad(prompt_ids, pad_id)
    return dataclasses.replace(batch, prompt_ids=ids, prompt_mask=mask, prompt_routing=None, response_routing=None)


def hint_rows(prompts: HintedPrompts) -> torch.Tensor:
    """[B] bool: rows that have a hinted prompt."""
    return torch.tensor([ids is not None for ids in prompts.prompt_ids], dtype=torch.bool)


@EXPERIENCE_WRAPPERS.register("hint_logprobs")
class HintLogprobs(ExperienceWrapper):
    """The inner maker's batch plus the log-probs of its responses under a hint (CPO)."""

    Config = HintConfig
    writes = ("hint_logprobs", "has_hint")

    def __init__(self, inner: ExperienceMaker, hint: HintConfig, gold_as_hint: bool, policy: Policy, tokenizer,
                 temperature: float):
        super().__init__(inner)
        self.hint = hint
        self.gold_as_hint = gold_as_hint
        self.policy = policy
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.summary_metrics = (*inner.summary_metrics, "cpo/mi_mean", "cpo/mi_positive_fraction")  # from the estimator

    @classmethod
    def from_context(cls, inner: ExperienceMaker, ctx: BuildContext) -> ExperienceMaker:
        """The wrapper when a later stage reads what it writes; otherwise `inner` untouched."""
        if not set(cls.writes) & ctx.reads_after_experience:
            return inner
        return cls(inner, ctx.cfg.cpo.hint, ctx.cfg.cpo.gold_as_hint, ctx.policy, ctx.tokenizer,
                   ctx.cfg.rollout.temperature)

    @classmethod
    def wrap_warmup_examples(cls, cfg, rows: list[PromptRow], examples: list[tuple[list[dict[str, str]], str]],
                             reads: frozenset[str]) -> list[tuple[list[dict[str, str]], str]]:
        """`examples` plus, with `cpo.hint.warmup_share` > 0 in a run whose advantage or loss reads the hint
        pass, that share of the rows (chosen by row id) on their hinted prompt, each with its gold solution:
        the embedded model has never seen a prompt holding a solution (a real LLM has), so without them the
        hint reads as noise and lowers the log-probs of the responses it agrees with (docs/variants/cpo.md).
        The whole hint is shown (`max_hint_length` is a token count of the run's tokenizer)."""
        share = cfg.cpo.hint.warmup_share
        if share == 0 or not set(cls.writes) & reads:
            return examples
        hinted = []
        for row in rows:
            hint = hint_text(row, cfg.cpo.gold_as_hint, cfg.cpo.hint.solution_fields)
            if hint is not None and random.Random(f"cpo/hint_warmup/{row.row_id}").random() < share:
                hinted.append((hinted_messages(row.messages, hint, cfg.cpo.hint, row.row_id), sft_target(row)))
        return examples + hinted

    def check_rows(self, rows: list[PromptRow]) -> None:
        """Every row has a hint and a user turn to hold it (`missing=skip`: rows without one are allowed)."""
        self.inner.check_rows(rows)
        check_hints(rows, self.hint, self.gold_as_hint)

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        batch, metrics = self.inner.make_experience(loader, step)
        if len(batch) == 0:  # a filtering maker kept nothing: the loop skips the update
            return batch, metrics
        metrics.update(self.add_hint_pass(batch))
        return batch, metrics

    def add_hint_pass(self, batch: ExperienceBatch) -> dict[str, float]:
        """Set hint_logprobs and has_hint on `batch`; return the hint metrics."""
        prompts = hinted_prompts(batch, self.tokenizer, self.hint, self.gold_as_hint)
        batch.has_hint = hint_rows(prompts)
        rows = torch.nonzero(batch.has_hint).flatten()
        batch.hint_logprobs = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        if len(rows):
            hinted = hinted_batch(batch.select(rows), [prompts.prompt_ids[i] for i in rows.tolist()],
                                  self.tokenizer.pad_token_id)
            batch.hint_logprobs[rows] = self.policy.logprobs(hinted, self.temperature)[0]
        lengths = prompts.hint_tokens
        return {
            "cpo/hint_rows": float(len(rows)),
            "cpo/hint_missing": float(prompts.num_missing),
            "cpo/hint_truncated": float(prompts.num_truncated),
            "cpo/hint_tokens_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        }
