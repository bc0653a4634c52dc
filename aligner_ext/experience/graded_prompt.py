"""Graded system prompt (RuscaRL): the n samples of one prompt see growing shares of its rubric.

For a prompt whose rubric has N items with non-zero points, and n > 1 samples, sample i (0-based)
is generated from the prompt plus a system message listing k_i of the N criteria:

    g_i = (n - 1 - i) / (n - 1)                       rule linear: 1, (n-2)/(n-1), ..., 0
    g_i = 1 if i < full_reveal_count else 0           rule binary
    r_i = g_i * d(step)                               d: step decay (none: 1), below
    k_i = floor(N r_i + 1/2)                          rounding half up, clamped to [0, N]

    x = step / (total_steps - 1)  (0 at the first step, 1 at the last; d = 1 if total_steps <= 1)
    d = 1 - x  (linear)  |  (1 - x)^step_power  (power)  |  1 / (1 + exp(k (x - x0)))  (sigmoid)

Each of the n inputs is sampled once and all n share the draw's group id (explicit: their prompt
tokens differ). The k_i criteria are a random subset drawn per sample, seeded by (trainer seed,
draw id, i), listed in rubric order: positive items as points to include with their points,
negative ones as points to avoid with their penalty; zero-point items are never listed. With
k_i = 0 there is no system message (or `base_system_prompt` if `base_when_zero`).

The policy trains on the draw's original prompt tokens (GroupSampling.assemble stores
`draw.prompt_ids`, untouched here), and the loop recomputes old and reference log-probs on them
with the policy. So the responses are sampled from pi(. | x, s_i) and trained as if from
pi(. | x): a deliberately off-policy update with no importance correction (as RuscaRL). The
engine's sampling log-probs (`rollout.return_logprobs`) were computed under s_i: diagnostics only
(every off-policy correction is refused with this maker, variants.py, generation ahead or not).
`keep_in_training` instead trains on the prompt the generator saw (system message included).
With partial rollouts (docs/async.md) a response parked at a refit resumes from its own generator
prompt, and each token's version is the one its engine call reports (`GroupSampling.assemble`). With
groups carried over (`rollout.carry_over`) each request holds its plan (`GradedRequest`): a carried sample
resumes from its own graded prompt, and the metrics read the plans of the requests a batch was assembled from.

Decisions (docs/variants/graded_prompt.md; tests/unit/experience/test_graded_prompt_*.py):
- Active only when `enabled`, sampling (`rollout.temperature` > 0) and `rollout.n` > 1; otherwise
  this maker samples exactly as GroupSampling. Validation never goes through a maker
  (trainer/evaluate.py answers the plain prompts, greedily or as trainer.eval samples).
- Rounding half up, not Python's round() (RuscaRL's, half to even: 2.5 -> 2), so k grows
  monotonically with the ratio. N counts only non-zero items, so k_i criteria are really shown.
- The system message goes through the tokenizer's own chat template (`encode_prompt` on the
  row's messages with a system message added), never spliced as hard-coded token ids. A row that
  already starts with a system message keeps it: the criteria are appended after a blank line
  (`existing_system: prepend` puts them first). RuscaRL instead prepends a second system turn.
- Draws left without a graded prompt are counted per reason: no rubric item with non-zero points,
  or a prompt the loader truncated (the messages no longer give its tokens back).
- The embedded tiny model has never seen a system message (a real LLM has). Its supervised warm-up
  (`warmup_examples`) therefore shows it the n graded prompts of every row, each with a target that
  meets every criterion shown and each criterion not shown with probability `warmup_unshown_share`
  (never a negative one), built from the items' `example` sentences. So it learns to follow the
  criteria it is shown, and answers without them only partly: the gap RL on the plain prompt closes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.data.loader import PromptLoader
from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.errors import ConfigError, DataError
from aligner_ext.experience.base import EXPERIENCE_MAKERS, GroupSampling, SampleRequest, without
from aligner_ext.experience.settings import GradedPromptConfig, RolloutConfig
from aligner_ext.rewards.rubric import judge_metrics

logger = logging.getLogger(__name__)

LOG_TAG = "[graded system prompt]"


def group_ratio(index: int, n: int, cfg: GradedPromptConfig) -> float:
    """g_i of sample `index` of `n` (n = 1 gives 1.0, as RuscaRL)."""
    if n == 1:
        return 1.0
    if cfg.rule == "binary":
        return 1.0 if index < cfg.full_reveal_count else 0.0
    return (n - 1 - index) / (n - 1)


def step_factor(step: int, total_steps: int, cfg: GradedPromptConfig) -> float:
    """d(step) for the 0-based `step` of `total_steps`."""
    if cfg.step_decay == "none" or total_steps <= 1:
        return 1.0
    x = min(1.0, max(0.0, step / (total_steps - 1)))
    if cfg.step_decay == "linear":
        return 1.0 - x
    if cfg.step_decay == "power":
        return (1.0 - x) ** cfg.step_power
    z = cfg.sigmoid_steepness * (x - cfg.sigmoid_start_point)
    return 1.0 / (1.0 + math.exp(z)) if z < 0 else math.exp(-z) / (1.0 + math.exp(-z))


def num_shown(num_items: int, ratio: float) -> int:
    """k = floor(N r + 1/2), clamped to [0, N]; N r is first rounded to 9 decimals so float noise cannot flip a half."""
    return min(num_items, max(0, math.floor(round(num_items * ratio, 9) + 0.5)))


def choose_criteria(items: list[dict[str, Any]], k: int, rng: random.Random) -> list[dict[str, Any]]:
    """A random subset of `k` items, kept in rubric order."""
    return [items[i] for i in sorted(rng.sample(range(len(items)), k))]


def system_message(shown: list[dict[str, Any]], cfg: GradedPromptConfig) -> str | None:
    """The system message listing `shown`; with none shown, the base prompt or None (no system message)."""
    if not shown:
        return cfg.base_system_prompt if cfg.base_when_zero else None
    positive = [item for item in shown if item["points"] > 0]
    negative = [item for item in shown if item["points"] < 0]
    blocks = [cfg.header]
    for heading, template, group in ((cfg.include_heading, cfg.include_item, positive),
                                     (cfg.avoid_heading, cfg.avoid_item, negative)):
        lines = [template.format(index=i, criterion=item["criterion"], points=f"{abs(item['points']):g}")
                 for i, item in enumerate(group, start=1)]
        if lines:
            blocks.append("\n".join(([heading] if heading else []) + lines))
    blocks.append(cfg.footer)
    if cfg.include_evaluation_warning:
        blocks.append(cfg.evaluation_warning)
    return "\n\n".join(block for block in blocks if block)


def generation_messages(messages: list[dict[str, str]], system: str, existing: str) -> list[dict[str, str]]:
    """`messages` with `system` as the system message, merged into a leading one if the row has it."""
    if messages and messages[0]["role"] == "system":
        own = messages[0]["content"]
        merged = f"{own}\n\n{system}" if existing == "append" else f"{system}\n\n{own}"
        return [{"role": "system", "content": merged}, *messages[1:]]
    return [{"role": "system", "content": system}, *messages]


def warmup_target(items: list[dict[str, Any]], shown: list[dict[str, Any]], unshown_share: float,
                  rng: random.Random) -> str:
    """A response meeting every positive item of `shown` and each other positive item with probability
    `unshown_share`: their `example` sentences in rubric order."""
    chosen = []
    for item in items:
        if item["points"] <= 0 or (item not in shown and rng.random() >= unshown_share):
            continue
        if not isinstance(item.get("example"), str):
            raise DataError(f"rubric item {item['criterion']!r} has no field 'example' (a sentence meeting it); "
                            "the graded system prompt's warm-up of the embedded model builds its targets from them")
        chosen.append(item["example"])
    return " ".join(chosen)


def inactive_reason(cfg: GradedPromptConfig, rollout: RolloutConfig) -> str | None:
    """Why the graded prompt is off for this run (None: it is on)."""
    if not cfg.enabled:
        return "graded_prompt.enabled is false"
    if rollout.temperature <= 0:
        return "rollout.temperature is 0 (greedy decoding, not sampling)"
    if rollout.n < 2:
        return f"rollout.n is {rollout.n} (a graded group needs n > 1)"
    return None


@dataclass
class GradedRequest(SampleRequest):
    """One sample's request and what its generator prompt disclosed: it travels with the request, so a group
    carried over to a later step (rollout.carry_over) keeps its plan, and a checkpoint holds it."""

    group_ratio: float | None = None  # g_i; None when the draw is sampled plain (see plain_reason)
    plain_reason: str = ""  # why the draw is sampled plain: no_rubric | truncated ("" when graded)
    shown: int = 0  # criteria listed
    system_tokens: int = 0  # generator prompt tokens minus original prompt tokens


@EXPERIENCE_MAKERS.register("graded_prompt", "graded_system_prompt")
class GradedPromptSampling(GroupSampling):
    """GroupSampling whose n generator inputs per prompt disclose 1, (n-2)/(n-1), ..., 0 of its rubric."""

    Config = GradedPromptConfig

    def __init__(self, cfg: RolloutConfig, graded: GradedPromptConfig, engine, rewards, tokenizer, seed: int = 0,
                 total_steps: int = 1, return_routing: bool = False):
        super().__init__(cfg, engine, rewards, tokenizer, seed=seed, return_routing=return_routing)
        self.graded = graded
        self.total_steps = total_steps
        self.inactive = inactive_reason(graded, cfg)
        self.step = 0
        self.plans: list[GradedRequest] = []  # the last batch's requests, aligned with its rows (`assemble`)
        self._logged: set[str] = set()  # plain-sampling reasons already logged
        ratios = sorted({group_ratio(i, cfg.n, graded) for i in range(cfg.n)}, reverse=True)
        self.summary_metrics = () if self.inactive else tuple(f"graded_prompt/reward_mean_r{g:.2f}" for g in ratios)
        if not self.inactive:  # its engine log-probs are under s_i, not the trained prompt: diagnostics only
            self.writes = without(self.writes, "generation_logprobs")
        if self.inactive:
            logger.info("%s off (%s): sampling the plain prompts", LOG_TAG, self.inactive)
        else:
            logger.info("%s on: n=%d, rule=%s, step_decay=%s, keep_in_training=%s", LOG_TAG, cfg.n, graded.rule,
                        graded.step_decay, graded.keep_in_training)

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "GradedPromptSampling":
        return cls(ctx.cfg.rollout, ctx.cfg.graded_prompt, ctx.engine, ctx.rewards, ctx.tokenizer,
                   seed=ctx.cfg.trainer.seed, total_steps=ctx.cfg.trainer.total_steps,
                   return_routing=ctx.policy.reads_routing)

    @classmethod
    def warmup_examples(cls, cfg, rows: list[PromptRow]) -> list[tuple[list[dict[str, str]], str]]:
        """Each row's n graded prompts (no step decay) with `warmup_target` responses (module docstring);
        a row without scored rubric items gets its plain prompt and gold solution, as in training."""
        graded, n = cfg.graded_prompt, cfg.rollout.n
        if inactive_reason(graded, cfg.rollout):
            return super().warmup_examples(cfg, rows)
        examples = []
        for row in rows:
            items = [item for item in (row.rubrics or []) if item["points"] != 0]
            if not items:  # sampled plain in training (plan_draw), so warmed up plain
                examples += super().warmup_examples(cfg, [row])
                continue
            for i in range(n):
                rng = random.Random(f"graded_prompt/warmup/{cfg.trainer.seed}/{row.row_id}/{i}")
                shown = choose_criteria(items, num_shown(len(items), group_ratio(i, n, graded)), rng)
                system = system_message(shown, graded)
                messages = row.messages if system is None else generation_messages(
                    row.messages, system, graded.existing_system)
                examples.append((messages, warmup_target(items, shown, graded.warmup_unshown_share, rng)))
        return examples

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        self.step = step  # requests() reads it for the step decay
        batch, metrics = super().make_experience(loader, step)
        metrics.update(self.metrics(batch))
        return batch, metrics

    def requests(self, draws: list[PromptDraw]) -> list[SampleRequest]:
        """n requests per draw, sample i disclosing k_i criteria (module docstring); plain when inactive."""
        if self.inactive:
            return super().requests(draws)
        decay = step_factor(self.step, self.total_steps, self.graded)
        planned = [request for draw in draws for request in self.plan_draw(draw, decay)]
        logger.debug("%s step %d: %d draws -> %d single samples (step factor %.4f)", LOG_TAG, self.step,
                     len(draws), len(planned), decay)
        return planned

    def assemble(self, requests: list[SampleRequest], outputs) -> ExperienceBatch:
        """The batch, its requests kept for `metrics`: with groups carried over, some were planned at earlier
        steps (under their step's decay), and the batch is not the latest draws'."""
        self.plans = [] if self.inactive else list(requests)
        return super().assemble(requests, outputs)

    def plan_draw(self, draw: PromptDraw, decay: float) -> list[GradedRequest]:
        """The n sample plans of one draw."""
        items = [item for item in (draw.row.rubrics or []) if item["points"] != 0]
        if not items:
            return self._plain(draw, "no_rubric")
        if encode_prompt(self.tokenizer, draw.row.messages) != draw.prompt_ids:
            return self._plain(draw, "truncated")
        plans = []
        for i in range(self.cfg.n):
            g = group_ratio(i, self.cfg.n, self.graded)
            k = num_shown(len(items), g * decay)
            rng = random.Random(f"graded_prompt/{self.seed}/{draw.draw_id}/{i}")
            system = system_message(choose_criteria(items, k, rng), self.graded)
            ids = draw.prompt_ids if system is None else self._encode(draw.row, system)
            trained = dataclasses.replace(draw, prompt_ids=ids) if self.graded.keep_in_training else draw
            plans.append(GradedRequest(trained, ids, draw.draw_id, g, "", k, len(ids) - len(draw.prompt_ids)))
            logger.debug("%s draw %d sample %d: ratio %.2f, %d/%d criteria, system prompt %d tokens%s", LOG_TAG,
                         draw.draw_id, i, g * decay, k, len(items), len(ids) - len(draw.prompt_ids),
                         f":\n{system}" if system else " (none)")
        return plans

    def _plain(self, draw: PromptDraw, reason: str) -> list[GradedRequest]:
        """n plain requests for a draw that gets no graded prompt; logged once per reason, counted in metrics."""
        if reason not in self._logged:
            self._logged.add(reason)
            why = {"no_rubric": "has no rubric item with non-zero points",
                   "truncated": "was truncated by the loader, so its messages no longer give its prompt tokens"}[reason]
            logger.warning("%s row %s %s: sampled plain (counted in graded_prompt/num_plain_samples_%s; "
                           "logged once)", LOG_TAG, draw.row.row_id, why, reason)
        return [GradedRequest(draw, draw.prompt_ids, draw.draw_id, None, reason) for _ in range(self.cfg.n)]

    def _encode(self, row: PromptRow, system: str) -> list[int]:
        messages = generation_messages(row.messages, system, self.graded.existing_system)
        try:
            return encode_prompt(self.tokenizer, messages)
        except TemplateError as err:  # e.g. templates that raise on a system role
            raise ConfigError(f"row {row.row_id}: the tokenizer's chat template cannot render a system message "
                              f"({type(err).__name__}: {err}); the graded system prompt (graded_prompt.enabled) "
                              "needs one") from err

    def check_rows(self, rows: list[PromptRow]) -> None:
        """When on, the chat template must render a system message: tried on the first row with a rubric."""
        if self.inactive:
            return
        row = next((row for row in rows if any(item["points"] != 0 for item in row.rubrics or [])), None)
        if row is not None:
            self._encode(row, self.graded.base_system_prompt)

    def metrics(self, batch: ExperienceBatch) -> dict[str, float]:
        """Reward mean per disclosure ratio, system-prompt tokens, plain draws, and the judge's statistics."""
        if not self.plans:
            return {"graded_prompt/active": 0.0}
        if len(self.plans) != len(batch):
            raise RuntimeError(f"{len(self.plans)} sample plans for a batch of {len(batch)}")
        graded = [(plan, float(reward)) for plan, reward in zip(self.plans, batch.rewards)
                  if plan.group_ratio is not None]
        by_ratio: dict[float, list[float]] = defaultdict(list)
        for plan, reward in graded:
            by_ratio[plan.group_ratio].append(reward)
        metrics = {"graded_prompt/active": 1.0,
                   "graded_prompt/step_factor": step_factor(self.step, self.total_steps, self.graded)}
        for reason in ("no_rubric", "truncated"):
            metrics[f"graded_prompt/num_plain_samples_{reason}"] = float(
                sum(plan.plain_reason == reason for plan in self.plans))
        metrics.update({f"graded_prompt/reward_mean_r{g:.2f}": sum(v) / len(v) for g, v in by_ratio.items()})
        if 1.0 in by_ratio and 0.0 in by_ratio:
            metrics["graded_prompt/reward_gap_full_minus_none"] = (
                metrics["graded_prompt/reward_mean_r1.00"] - metrics["graded_prompt/reward_mean_r0.00"])
        if graded:
            tokens = [plan.system_tokens for plan, _ in graded]
            metrics["graded_prompt/system_prompt_tokens_mean"] = sum(tokens) / len(tokens)
            metrics["graded_prompt/system_prompt_tokens_max"] = float(max(tokens))
            metrics["graded_prompt/criteria_shown_mean"] = sum(plan.shown for plan, _ in graded) / len(graded)
        metrics.update(judge_metrics([sample.reward_info for sample in batch.samples]))
        return metrics
