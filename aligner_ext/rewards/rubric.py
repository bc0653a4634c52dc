"""Rubric rewards, HealthBench style: each criterion judged met or not, points summed.

For a row with rubric items (criterion c_j, points p_j) and verdicts m_j in {0, 1}:

    score = sum_j m_j p_j / sum_{j: p_j > 0} p_j

Met negative items subtract, so the score is at most 1 and can be negative (HealthBench's
`calculate_score` in openai/simple-evals `healthbench_eval.py`; RuscaRL trains on the same value).
Zero-point items change nothing and are not graded.

Graders (who decides m_j):
- `rule`: the item's machine-checkable `check` spec, through `check_passes` of the built-in
  `rubric_qa` task (aligner_ext/data/tasks/rubric_qa.py). Deterministic; an item without `check` is an
  error naming the row and the item.
- `judge`: one chat-completions request per item (`judge_client.JudgeClient`), the HealthBench
  protocol: the grader prompt (`conf/judge/rubric_grader.txt`) gets the row's conversation plus the
  response, rendered "role: content" and joined by blank lines, and the item as "[points]
  criterion"; the reply must be JSON with a boolean `criteria_met` (a reply without one is
  retried). The conversation is the row's own messages, so a graded system prompt the generator
  saw is never shown to the judge.

Registered rewards (none is bound to a data_source; map one with `reward.sources.<source>=<name>`,
as conf/variant/graded_prompt.yaml does for `rubric_qa`):
`rubric` (rule), `rubric_clipped` (rule, score clipped to [0, 1]), `rubric_judge` (judge),
`rubric_judge_clipped` (judge, clipped). Their judge is the run config's `reward.judge`
(`with_reward_config`, called by the reward manager); a reward built in user code with its own
JudgeConfig keeps it: `my_judge = RubricReward(RubricConfig(grader="judge", judge=JudgeConfig(...)))`,
given as `reward.sources.<source>=my_pkg.module:my_judge` (two judges in one run, say).

Decisions:
- Unclipped by default, as RuscaRL trains; HealthBench clips only the dataset mean. Clipping per
  sample (the `_clipped` names) hides how badly a response breaks negative items.
- `correct` is 1.0 when every positive item is met and no negative one (the score is exactly 1),
  else 0.0: accuracy metrics then read "perfect responses".
- A row without positive points has no defined score: an error (HealthBench returns None, RuscaRL
  0.0), which the reward manager turns into a counted, logged fallback.
- Where the judge runs: inside the reward worker processes, like every reward
  (aligner_ext/rewards/manager.py), so the manager's per-call time limit, fallbacks and metrics
  apply unchanged and nothing new runs in the trainer. The reward object carries its config by
  value (it is pickled to the worker, the run's judge config bound in). Each worker keeps one client per JudgeConfig (its cache and concurrency
  limit), and a response's items are judged concurrently on that client's threads. So at most
  `reward.num_workers * max_concurrency` requests are in flight, and `reward.timeout_s` must cover
  a response's grading (JudgeConfig.worst_case_s() per item in the worst case).
- A judge failure after all retries raises (JudgeUnavailable / JudgeError): the manager scores
  the response `reward.fallback_score`, counts it and logs the message; it is never silently
  read as "not met".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aligner_ext.data.tasks.rubric_qa import check_passes
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult, register_reward
from aligner_ext.rewards.judge_client import JudgeClient, JudgeConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # relative judge templates resolve here
GRADERS = ("rule", "judge")
PLACEHOLDERS = ("<<conversation>>", "<<rubric_item>>")
JUDGE_ERRORS = ("JudgeError", "JudgeUnavailable")  # exception names the reward manager reports for judge failures
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_CLIENTS: dict[tuple, JudgeClient] = {}  # one client per judge config (JudgeConfig.key) in each process


@dataclass(frozen=True)
class RubricConfig:
    """How a rubric reward grades and scores."""

    grader: str = "rule"  # rule (the items' `check` specs) | judge (an LLM judge per item)
    clip: bool = False  # clip each score to [0, 1]; False keeps HealthBench's raw score (<= 1, may be negative)
    judge: JudgeConfig | None = None  # the judge; None: the run's reward.judge (JudgeConfig() outside a run)

    def __post_init__(self) -> None:
        if self.grader not in GRADERS:
            raise ValueError(f"rubric grader must be one of {GRADERS}, got {self.grader!r}")


def rubric_score(points: list[float], met: list[bool]) -> float:
    """sum of the met items' points / sum of the positive points (unclipped)."""
    possible = sum(p for p in points if p > 0)
    if possible <= 0:
        raise ValueError("the rubric has no positive points, so its score is undefined")
    return sum(p for p, m in zip(points, met) if m) / possible


class RubricReward:
    """A reward function `(response, row) -> RewardResult` scoring the row's rubric; picklable by value."""

    def __init__(self, cfg: RubricConfig):
        self.cfg = cfg

    def __call__(self, response: str, row: PromptRow) -> RewardResult:
        items = [item for item in (row.rubrics or []) if item["points"] != 0]
        if not items:
            raise ValueError(f"row {row.row_id} has no rubric items with non-zero points")
        points = [float(item["points"]) for item in items]
        info: dict[str, Any] = {"grader": self.cfg.grader}
        if self.cfg.grader == "rule":
            met = rule_verdicts(items, response, row.row_id)
        else:
            met, stats = judge_verdicts(items, row.messages, response, self.cfg.judge)
            info.update(stats)
        raw = rubric_score(points, met)
        perfect = all(m == (p > 0) for p, m in zip(points, met))
        info.update(criteria_met=met, raw_score=raw)
        score = min(1.0, max(0.0, raw)) if self.cfg.clip else raw
        return RewardResult(score=score, correct=float(perfect), info=info)

    def with_reward_config(self, reward_cfg) -> "RubricReward":
        """This reward with the run's judge (`reward.judge`) when it grades with a judge of its own unset."""
        if self.cfg.grader != "judge" or self.cfg.judge is not None:
            return self
        return RubricReward(dataclasses.replace(self.cfg, judge=reward_cfg.judge))

    def __repr__(self) -> str:
        return f"RubricReward({self.cfg!r})"


def rule_verdicts(items: list[dict[str, Any]], response: str, row_id: str) -> list[bool]:
    """Each item's `check` spec applied to the response."""
    verdicts = []
    for index, item in enumerate(items):
        if "check" not in item:
            raise ValueError(f"row {row_id}: rubric item {index} ({item['criterion']!r}) has no `check` spec for "
                             "the rule grader; grade this data with a judge (rubric_judge)")
        verdicts.append(check_passes(item["check"], response))
    return verdicts


def judge_verdicts(items: list[dict[str, Any]], messages: list[dict[str, str]], response: str,
                   judge: JudgeConfig | None) -> tuple[list[bool], dict[str, float]]:
    """One judge request per item, run concurrently; the verdicts and request statistics."""
    cfg = judge if judge is not None else JudgeConfig()
    client = _client(cfg)
    template = load_template(cfg.template)
    conversation = render_conversation(messages, response)

    def grade(item: dict[str, Any]):
        prompt = template.replace("<<conversation>>", conversation).replace("<<rubric_item>>", rubric_line(item))
        return client.complete([{"role": "user", "content": prompt}], parse_verdict)

    outcomes = client.map(grade, items)
    requested = [o for o in outcomes if not o.cached]
    stats = {
        "judge_calls": float(len(requested)),
        "judge_cache_hits": float(len(outcomes) - len(requested)),
        "judge_retries": float(sum(o.attempts - 1 for o in requested)),
        "judge_latency_s": float(sum(o.latency_s for o in requested)),
        "judge_latency_max_s": float(max((o.latency_s for o in requested), default=0.0)),
    }
    return [o.value for o in outcomes], stats


def rubric_line(item: dict[str, Any]) -> str:
    """HealthBench's rendering of one item: "[points] criterion"."""
    return f"[{item['points']:g}] {item['criterion']}"


def render_conversation(messages: list[dict[str, str]], response: str) -> str:
    """The conversation plus the response as "role: content" turns joined by blank lines."""
    turns = [*messages, {"role": "assistant", "content": response}]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in turns)


def parse_verdict(text: str) -> bool:
    """`criteria_met` of a JSON reply (optionally in a ```json fence); ValueError if there is none."""
    body = _FENCE.sub("", text.strip())
    try:
        reply = json.loads(body)
    except json.JSONDecodeError:
        match = re.search(r"\{.*\}", body, flags=re.DOTALL)  # JSON with prose around it
        if match is None:
            raise ValueError("no JSON object in the reply") from None
        try:
            reply = json.loads(match.group(0))
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON: {err}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("criteria_met"), bool):
        raise ValueError("the reply has no boolean 'criteria_met'")
    return reply["criteria_met"]


@functools.lru_cache(maxsize=8)
def load_template(path: str) -> str:
    """The grader prompt at `path` (absolute or relative to conf/); it must hold both placeholders."""
    file = Path(path) if Path(path).is_absolute() else CONF_DIR / path
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read the judge template {file}: {err}") from err
    missing = [p for p in PLACEHOLDERS if p not in text]
    if missing:
        raise ValueError(f"judge template {file} lacks the placeholders {missing}")
    return text


def judge_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Judge requests, cache hits, retries, latency and failures over one batch's reward infos ({} if no judge ran).

    A failure is a response whose reward fell back because the judge raised (JudgeError or
    JudgeUnavailable); a reward call killed at `reward.timeout_s` counts in reward/num_timeouts.
    """
    graded = [info for info in infos if info.get("grader") == "judge"]
    failed = sum(1 for info in infos
                 if info.get("fallback") == "error" and str(info.get("error", "")).startswith(JUDGE_ERRORS))
    if not graded and not failed:
        return {}
    requests = sum(info["judge_calls"] for info in graded)
    return {
        "judge/num_requests": requests,
        "judge/num_cache_hits": sum(info["judge_cache_hits"] for info in graded),
        "judge/num_retries": sum(info["judge_retries"] for info in graded),
        "judge/num_failures": float(failed),
        "judge/latency_mean_s": sum(info["judge_latency_s"] for info in graded) / requests if requests else 0.0,
        "judge/latency_max_s": max((info["judge_latency_max_s"] for info in graded), default=0.0),
    }


def _client(cfg: JudgeConfig) -> JudgeClient:
    if cfg.key() not in _CLIENTS:
        _CLIENTS[cfg.key()] = JudgeClient(cfg)
    return _CLIENTS[cfg.key()]


# RuscaRL's HealthBench rows are graded by an LLM judge against their rubrics (docs/rewards.md); the built-in
# rubric tasks' items (rubric_qa, number_facts) carry check specs, which the rule grader reads.
_SOURCES = {"rubric_judge": ("healthbench",), "rubric": ("rubric_qa", "number_facts")}
for _name, _cfg in (
    ("rubric", RubricConfig(grader="rule")),
    ("rubric_clipped", RubricConfig(grader="rule", clip=True)),
    ("rubric_judge", RubricConfig(grader="judge")),
    ("rubric_judge_clipped", RubricConfig(grader="judge", clip=True)),
):
    register_reward(_name, data_sources=_SOURCES.get(_name, ()))(RubricReward(_cfg))
