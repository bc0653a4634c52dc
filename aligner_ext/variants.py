"""Which variants a config turns on, and which of them compose.

A variant is on when its switch is: dynamic sampling `dynamic_sampling.enabled`; CPO
`algorithm.adv_estimator=cpo` (or a CPO wrapper in `cpo.wrap_method`); MTPO the `two_round`
maker (or its `mtpo_segments` estimator); the graded system prompt its maker (or
`graded_prompt.enabled`). `+variant=a +variant=b` is read as `+variant=[a,b]`: the overlays are
merged in order, and a single-valued key two overlays set keeps the later value, so the switches
are read after the merge and every pair that is on is checked against `PAIRS`. A pair either
composes, with the semantics written in docs/variants/README.md, or is refused naming both.
A composing pair may adjust settings of the other: dynamic sampling under MTPO filters by segment
and leaves the dapo overlay's overlong shaping off.
The switches beside the variants (the estimators and losses researchers compare with, DAPO's overlong
techniques) are checked against every variant that is on, through `SWITCH_REFUSALS`: a pair not
listed there composes.
Two more tables keep every setting read: a switch whose experience wrapper `algorithm.experience_wrappers`
does not list is refused (`APPLIED_BY`), and so is a setting that only switches that are off read
(`READ_ONLY_UNDER`), given on the command line or set by a config file; set by a variant's overlay, it is
warned about once instead: the overlay sets it for the variant's usual loss, and the user cannot unset it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from omegaconf import OmegaConf

from aligner_ext.losses.settings import CORRECTIONS, correction_mode
from aligner_ext.plugin_names import CANONICAL
from aligner_ext.secrets import redact

ESTIMATORS, LOSSES = "aligner_ext.algorithms.advantages:ADVANTAGES", "aligner_ext.losses.base:LOSSES"  # registries
MAKERS = "aligner_ext.experience.base:EXPERIENCE_MAKERS"
BACKENDS = "aligner_ext.models.base:POLICIES"

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


_SEGMENTS = ("MTPO's answers and confidences are compared over different groups (algorithm.adv_estimator="
             "mtpo_segments); a single-round estimator would baseline their summed reward over all G x H samples")
_CPO_ESTIMATOR = ("both set algorithm.adv_estimator (CPO's wrappers shape GRPO's advantages, algorithm.adv_estimator="
                  "cpo); one would silently replace the other")
_GRADED_LOGPROBS = ("the engine samples under per-sample system prompts, so its log-probs are not those of the trained "
                    "prompt: their ratio to the trainer's measures the system prompt, not an engine mismatch")
_OWN_CAPS = ("two-round rollouts have caps of their own (mtpo.max_answer_length, mtpo.max_confidence_length), not "
             "rollout.max_response_length")
# (switch, variant) -> why they do not compose; every other pair does (docs/variants/README.md).
SWITCH_REFUSALS: dict[tuple[str, str], str] = {
    ("algorithm.adv_estimator=rloo", "cpo"): _CPO_ESTIMATOR,
    ("algorithm.adv_estimator=reinforce_plus_plus", "cpo"): _CPO_ESTIMATOR,
    ("algorithm.adv_estimator=reinforce_plus_plus_baseline", "cpo"): _CPO_ESTIMATOR,
    ("algorithm.adv_estimator=rloo", "mtpo"): _SEGMENTS,
    ("algorithm.adv_estimator=reinforce_plus_plus", "mtpo"): _SEGMENTS,
    ("algorithm.adv_estimator=reinforce_plus_plus_baseline", "mtpo"): _SEGMENTS,
    ("algorithm.loss=gspo", "mtpo"): "GSPO clips one ratio per sequence, and a two-round sample holds two segments "
                                     "with advantages of their own (its answer masked out in all but one copy)",
    **{(f"loss.off_policy_correction={mode}", "graded_prompt"): _GRADED_LOGPROBS for mode in CORRECTIONS[1:]},
    ("algorithm.experience_maker=agent_episodes", "mtpo"): "both set algorithm.experience_maker (agent_episodes, "
                                                           "two_round); one would silently replace the other",
    ("algorithm.experience_maker=agent_episodes", "graded_prompt"): "both set algorithm.experience_maker "
                                                                    "(agent_episodes, graded_prompt)",
    ("algorithm.experience_maker=agent_episodes", "cpo"): "CPO's hinted log-prob pass is not yet defined over an "
                                                          "agent episode's observation tokens (docs/agents.md)",
    ("rollout.overlong_buffer_fraction>0", "mtpo"): _OWN_CAPS,
    ("rollout.overlong_filter=true", "mtpo"): _OWN_CAPS,
}


# switch -> the experience wrapper that applies it, which algorithm.experience_wrappers must list.
APPLIED_BY: dict[str, str] = {
    "dynamic_sampling.enabled=true": "dynamic_sampling",
    "rollout.overlong_buffer_fraction>0": "overlong",
    "rollout.overlong_filter=true": "overlong",
    "algorithm.adv_estimator=cpo": "hint_logprobs",  # the CPO advantage reads the hint log-probs it adds
}

_MASKS = ("loss.off_policy_correction=token_mask", "loss.off_policy_correction=sequence_mask")
# setting (a key, or a section ending in ".") -> the switches under which alone it is read (active_switches'
# spelling); set under none of them it has no effect (`check_unread`). A switch's own key is never judged.
READ_ONLY_UNDER: dict[str, tuple[str, ...]] = {
    "loss.epsilon": ("algorithm.loss=clipped_pg",),  # GSPO and CISPO clip at loss.gspo.* and loss.cispo.*
    "loss.epsilon_high": ("algorithm.loss=clipped_pg",),
    "loss.clip_ratio_c": ("algorithm.loss=clipped_pg",),
    "loss.gspo.": ("algorithm.loss=gspo",),
    "loss.cispo.": ("algorithm.loss=cispo",),
    "loss.importance_sampling_low": _MASKS,
    "loss.importance_sampling_high": _MASKS,
    "dynamic_sampling.": ("dynamic_sampling.enabled=true",),
    "rollout.overlong_penalty": ("rollout.overlong_buffer_fraction>0",),
    "mtpo.": ("algorithm.experience_maker=two_round",),
    "agents.": ("algorithm.experience_maker=agent_episodes",),
    "trainer.asynchronous.max_staleness": ("trainer.asynchronous.enabled=true",),
    "trainer.asynchronous.partial_rollouts": ("trainer.asynchronous.enabled=true",),
    "policy.optim.master_weights": ("policy.backend=hf",),  # megatron-core's optimizer always keeps float32 masters
    "advantage.": tuple(f"algorithm.adv_estimator={name}" for name in  # RLOO divides by no std
                        ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "mtpo_segments", "cpo")),
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


def overlay_settings(overrides: list[str], config_dir: Path) -> frozenset[str]:
    """The dotted keys the overlays `+variant=...` of `overrides` set (conf/variant/<name>.yaml)."""
    keys = set()
    for override in overrides:
        match = _VARIANT_OVERRIDE.match(override)
        for name in (match.group(1).strip("[] ").split(",") if match else []):
            overlay = config_dir / "variant" / f"{name.strip()}.yaml"
            if overlay.is_file():
                keys |= set(flatten(OmegaConf.to_container(OmegaConf.load(overlay))))
    return frozenset(keys)


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


def resolve_variants(cfg, given: dict[str, str] | None = None, from_overlays: frozenset[str] = frozenset()) -> None:
    """Refuse a pair of variants that does not compose, a switch that does not compose with a variant
    (`check_switches`), or a setting that nothing would read (`check_unread`: `given`, the keys the command
    line set, each with the name it was given by; `from_overlays`, those the variant overlays set); turn the
    graded maker on from its switch alone (the original recipe's behaviour), and under MTPO dynamic
    sampling's segment filter on and the dapo overlay's overlong shaping off."""
    algorithm = cfg.algorithm
    active = sorted(active_variants(cfg))
    for index, first in enumerate(active):
        for second in active[index + 1:]:
            reason = PAIRS[frozenset({first, second})]
            if reason is not None:
                raise ValueError(f"variants {first} and {second} do not compose: {reason} (docs/variants/README.md)")
    if {"dapo", "mtpo"} <= set(active):
        _filter_by_segments(cfg.dynamic_sampling)
        _no_overlong_shaping(cfg.rollout)
    check_switches(cfg, active)
    check_unread(cfg, active_switches(cfg), given or {}, from_overlays)
    wrap_method = cfg.cpo.wrap_method
    if wrap_method != "none" and algorithm.adv_estimator != "cpo":
        raise ValueError(f"cpo.wrap_method={wrap_method} is read only by algorithm.adv_estimator=cpo "
                         f"(it is {algorithm.adv_estimator}); set wrap_method=none or adv_estimator=cpo")
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


def _no_overlong_shaping(rollout) -> None:
    """Under MTPO, the dapo overlay's overlong shaping is left off: two-round rollouts have caps of their own."""
    if rollout.overlong_buffer_fraction > 0:
        logger.info("dynamic sampling with MTPO: rollout.overlong_buffer_fraction set to 0 (%s)", _OWN_CAPS)
        rollout.overlong_buffer_fraction = 0.0


def active_switches(cfg) -> set[str]:
    """The switches beside the variants that `cfg` sets, spelt as in SWITCH_REFUSALS (registered names, not aliases)."""
    estimator, loss, maker = cfg.algorithm.adv_estimator, cfg.algorithm.loss, cfg.algorithm.experience_maker
    switches = {f"algorithm.adv_estimator={CANONICAL[ESTIMATORS].get(estimator, estimator)}",
                f"algorithm.loss={CANONICAL[LOSSES].get(loss, loss)}",
                f"algorithm.experience_maker={CANONICAL[MAKERS].get(maker, maker)}",
                f"policy.backend={CANONICAL[BACKENDS].get(cfg.policy.backend, cfg.policy.backend)}"}
    if cfg.dynamic_sampling.enabled:
        switches.add("dynamic_sampling.enabled=true")
    if correction_mode(cfg.loss) != "none":
        switches.add(f"loss.off_policy_correction={correction_mode(cfg.loss)}")
    if cfg.rollout.overlong_buffer_fraction > 0:
        switches.add("rollout.overlong_buffer_fraction>0")
    if cfg.rollout.overlong_filter:
        switches.add("rollout.overlong_filter=true")
    if cfg.trainer.asynchronous.enabled:
        switches.add("trainer.asynchronous.enabled=true")
    return switches


def check_switches(cfg, active: list[str]) -> None:
    """Refuse a switch that does not compose with a variant that is on (SWITCH_REFUSALS), or whose experience
    wrapper is not listed (APPLIED_BY): nothing would apply it."""
    switches = sorted(active_switches(cfg))
    for switch in switches:
        for variant in active:
            reason = SWITCH_REFUSALS.get((switch, variant))
            if reason is not None:
                raise ValueError(f"{switch} and variant {variant} do not compose: {reason} (docs/variants/README.md)")
        wrapper = APPLIED_BY.get(switch)
        if wrapper is not None and wrapper not in cfg.algorithm.experience_wrappers:
            raise ValueError(f"{switch} is applied by the experience wrapper {wrapper}, which "
                             "algorithm.experience_wrappers does not list")


def check_unread(cfg, switches: set[str], given: dict[str, str], from_overlays: frozenset[str] = frozenset()) -> None:
    """Refuse a setting of READ_ONLY_UNDER that none of its switches reads here, given on the command line
    (`given`: our key -> the name it was given by, a recipe's or verl's perhaps) or set to other than its
    default by a config file; warn once of one only a variant's overlay set (`from_overlays`). Under a
    plug-in of a dotted path (user code) nothing is judged: what it reads is unknown."""
    defaults = flatten(redact(dataclasses.asdict(type(cfg)())))
    for key, value in flatten(redact(dataclasses.asdict(cfg))).items():
        readers = next((switches_ for setting, switches_ in READ_ONLY_UNDER.items()
                        if key == setting or (setting.endswith(".") and key.startswith(setting))), ())
        tested = {_switch_key(switch) for switch in readers}
        if not readers or key in tested or set(readers) & switches:
            continue
        chosen = sorted(switch for switch in switches if _switch_key(switch) in tested)  # e.g. algorithm.loss=gspo
        if any(_is_dotted_path(switch.partition("=")[2]) for switch in chosen):
            continue
        named = f"{given[key]}={value} (read as {key})" if given.get(key, key) != key else f"{key}={value}"
        reason = (f"{named} has no effect: it is read only under {' or '.join(readers)}"
                  + (f", not under {', '.join(chosen)}" if chosen else ""))
        if key in given or (value != defaults.get(key) and key not in from_overlays):
            raise ValueError(f"{reason}; leave it out")
        if value != defaults.get(key):
            logger.warning("%s (a variant's overlay sets it; ignored)", reason)


def _is_dotted_path(name: str) -> bool:
    """A plug-in name that is user code (`pkg.module:attr`), as rules.Registered reads one."""
    return "." in name or ":" in name


def _switch_key(switch: str) -> str:
    """The setting a switch tests: `algorithm.loss=gspo` -> algorithm.loss, `rollout.overlong_buffer_fraction>0` -> ..."""
    return re.split(r"[=<>]", switch, maxsplit=1)[0]


def flatten(tree, prefix: str = "") -> dict:
    """A nested config container as {dotted key: leaf value}; an empty section is one leaf."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) and value else
                    {f"{prefix}{key}": value})
    return flat
