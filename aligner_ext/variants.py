"""Which variants a config turns on, and which of them compose.

A variant is on when its switch is: dynamic sampling `dynamic_sampling.enabled`; CPO
`algorithm.adv_estimator=cpo` (or a CPO wrapper in `cpo.wrap_method`); MTPO the `two_round`
maker (or its `mtpo_segments` estimator); the graded system prompt its maker (or
`graded_prompt.enabled`). `+variant=a +variant=b` is read as `+variant=[a,b]`: the overlays are
merged in order, and a single-valued key two overlays set keeps the later value, so the switches
are read after the merge and every pair that is on is checked against `PAIRS`. A pair either
composes, with the semantics written in docs/variants/README.md, or is refused naming both.
A composing pair may adjust one setting of the other: dynamic sampling under MTPO filters by segment.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

_VARIANT_OVERRIDE = re.compile(r"^\+variant=(.*)$")

# None: composes (docs/variants/README.md); otherwise why the pair is refused.
PAIRS: dict[frozenset[str], str | None] = {
    frozenset({"dapo", "cpo"}): None,
    frozenset({"dapo", "graded_prompt"}): None,
    frozenset({"dapo", "mtpo"}): None,
    frozenset({"cpo", "mtpo"}): "both set algorithm.adv_estimator (CPO's wrappers over GRPO advantages, MTPO's "
                                "segment advantages); one would silently replace the other",
    frozenset({"cpo", "graded_prompt"}): "CPO's hinted log-prob pass and the graded maker's per-sample system prompts "
                                         "have no defined semantics together yet",
    frozenset({"mtpo", "graded_prompt"}): "both set algorithm.experience_maker (two_round, graded_prompt); one would "
                                          "silently replace the other",
}


def merge_variant_overrides(overrides: list[str]) -> list[str]:
    """`+variant=a ... +variant=b` as one `+variant=[a,b]` where the first stood (Hydra refuses two)."""
    names, position = [], None
    kept = []
    for override in overrides:
        match = _VARIANT_OVERRIDE.match(override)
        if match is None:
            kept.append(override)
            continue
        position = len(kept) if position is None else position
        value = match.group(1).strip()
        names += [n.strip() for n in value.strip("[]").split(",") if n.strip()] if value.startswith("[") else [value]
    if position is None or len(names) < 2:
        return overrides
    return kept[:position] + [f"+variant=[{','.join(names)}]"] + kept[position:]


def active_variants(cfg) -> set[str]:
    """The variants whose switch is on in `cfg` (module docstring)."""
    algorithm = cfg.algorithm
    active = set()
    if cfg.dynamic_sampling.enabled:
        active.add("dapo")
    if algorithm.adv_estimator == "cpo" or cfg.cpo.wrap_method != "none":
        active.add("cpo")
    if algorithm.experience_maker == "two_round" or algorithm.adv_estimator == "mtpo_segments":
        active.add("mtpo")
    if algorithm.experience_maker == "graded_prompt" or cfg.graded_prompt.enabled:
        active.add("graded_prompt")
    return active


def resolve_variants(cfg) -> None:
    """Refuse a pair of variants that does not compose, or a variant's setting that nothing would
    read; turn the graded maker on from its switch alone (the seed's behaviour) and dynamic sampling's
    segment filter on under MTPO."""
    algorithm = cfg.algorithm
    active = sorted(active_variants(cfg))
    for index, first in enumerate(active):
        for second in active[index + 1:]:
            reason = PAIRS[frozenset({first, second})]
            if reason is not None:
                raise ValueError(f"variants {first} and {second} do not compose: {reason} (docs/variants/README.md)")
    wrap_method = cfg.cpo.wrap_method
    if wrap_method != "none" and algorithm.adv_estimator != "cpo":
        raise ValueError(f"cpo.wrap_method={wrap_method} is read only by algorithm.adv_estimator=cpo "
                         f"(it is {algorithm.adv_estimator}); set wrap_method=none or adv_estimator=cpo")
    if {"dapo", "mtpo"} <= set(active):
        _filter_by_segments(cfg.dynamic_sampling)
    if cfg.graded_prompt.enabled and algorithm.experience_maker == "group_sampling":
        logger.info("graded_prompt.enabled=true: algorithm.experience_maker set to graded_prompt")
        algorithm.experience_maker = "graded_prompt"
    if "dapo" in active and wrap_method.startswith("negonly"):
        logger.warning("dynamic sampling keeps only groups with mixed outcomes, so %s's terms for all-wrong groups "
                       "never fire (docs/variants/README.md)", wrap_method)


def _filter_by_segments(dynamic_sampling) -> None:
    """Under MTPO, dynamic sampling judges a group by both segments' rewards (experience/filters.py):
    the default answer-correctness filter would drop groups whose confidences still carry signal."""
    if dynamic_sampling.filter_metric == "seq_reward":
        raise ValueError("dynamic_sampling.filter_metric=seq_reward sums MTPO's answer and confidence rewards, whose "
                         "differences can cancel; use filter_metric=segments (or correct, read as segments)")
    if dynamic_sampling.filter_metric == "correct":
        logger.info("dynamic sampling with MTPO: dynamic_sampling.filter_metric set to segments")
        dynamic_sampling.filter_metric = "segments"
