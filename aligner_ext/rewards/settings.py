"""Settings of the reward functions.

The dataclasses of their config sections, each field with its rule, kept free of torch and of the code
that uses them: composing and checking a configuration (`aligner-ext config`, `load_config`) never
imports a model library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from aligner_ext.rules import number, plugin


@dataclass
class SegmentRewardsConfig:
    """Segment rewards of MTPO: weights of each term and the format check of each segment."""

    correctness_weight: float = number(1.0)  # answer side: weight of the row's reward (by data_source), e.g. exact match
    answer_format: str = plugin("format_answer_segment", "aligner_ext.rewards.base:REWARDS")  # reward name checking the round-1 text's format
    answer_format_weight: float = number(0.5)  # answer side: weight of that format check
    calibration_weight: float = number(1.0)  # confidence side: weight of 1 - (c - correct)^2
    confidence_format: str = plugin("format_confidence_segment", "aligner_ext.rewards.base:REWARDS")  # format_confidence_segment (<analysis> required) | format_confidence_segment_lenient (optional) | a reward name
    confidence_format_weight: float = number(0.5)  # confidence side: weight of that format check


@dataclass
class JudgeConfig:
    """An OpenAI-compatible chat-completions judge: endpoint, model and limits."""

    base_url: str = "http://127.0.0.1:8000/v1"  # endpoint root; requests go to <base_url>/chat/completions
    model: str = "judge"  # model name sent with every request
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key (never logged); unset: no key sent
    template: str = "judge/rubric_grader.txt"  # grader prompt: a path, absolute or relative to conf/
    temperature: float = number(0.0, ge=0)  # judge sampling temperature
    max_tokens: int = number(1024, ge=1)  # cap on the judge's reply, in tokens
    timeout_s: float = number(60.0, gt=0)  # limit per HTTP request (connect and each read), seconds
    max_retries: int = number(3, ge=0)  # further attempts after a failed request or an unparseable reply
    backoff_s: float = number(1.0, ge=0)  # wait before the first retry, seconds; doubled before each later one
    max_concurrency: int = number(8, ge=1)  # requests in flight at once per client (per reward worker process)
    cache_size: int = number(10000, ge=0)  # parsed replies kept for identical requests; 0 disables the cache

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must start with http:// or https://, got {self.base_url!r}")

    def key(self) -> tuple:
        """The field values: equal configs share one client (its cache and limit) in a process."""
        return dataclasses.astuple(self)

    def worst_case_s(self) -> float:
        """Longest one `complete` call can take: every attempt timing out, plus the backoff waits."""
        waits = sum(self.backoff_s * 2**k for k in range(self.max_retries))
        return self.timeout_s * (self.max_retries + 1) + waits


@dataclass
class RewardConfig:
    """Which reward function scores each data_source, and the limits on a call."""

    sources: dict[str, str] = field(default_factory=dict)  # data_source -> reward name or 'pkg.module:fn' (wins)
    default: str | None = None  # reward for a data_source in no table; None: such a row is a config error
    timeout_s: float = number(10.0, gt=0)  # wall-clock limit per call, seconds; then its worker is killed, score fallback_score
    fallback_score: float = number(0.0)  # score of a call that raised, timed out or returned a bad value
    num_workers: int = number(2, ge=1)  # worker processes
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the LLM judge of judge-graded rewards (rubric_judge)
    split_across_ranks: bool = True  # under torchrun each process scores a contiguous share of every score() call and the results are all-gathered; false: every process scores everything
