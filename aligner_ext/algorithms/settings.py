"""Settings of the advantage estimators.

The dataclasses of their config sections, each field with its rule, kept free of torch and of the code
that uses them: composing and checking a configuration (`aligner-ext config`, `load_config`) never
imports a model library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aligner_ext.data.settings import HintConfig
from aligner_ext.plugin_names import MIN_GROUP_SIZE
from aligner_ext.rules import choice, number, plugin

UNCERTAINTY_MODES = ("minmax", "vocab")
DIFFICULTY_MODES = ("three", "five", "variance")


@dataclass
class CPOConfig:
    """CPO's hint source and advantage shaping (on with `algorithm.adv_estimator=cpo`)."""

    gold_as_hint: bool = True  # CPO hint: extra_info.gold_solution (true) or the ground truth (docs/variants/cpo.md)
    wrap_method: str = plugin("none", "aligner_ext.algorithms.cpo_wrappers:CPO_WRAPPERS")  # CPO advantage wrapper (algorithms/cpo_wrappers.py); none = GRPO advantages
    cpo_lambda: float = number(5.0, gt=1)  # ratio clamp [1/λ, λ] of exp(lp_hint - lp), > 1; read by naive* and noaccmask only
    pos_alpha: float = number(0.05, ge=0)  # weight of the terms on correct rows (the CPO guide's default; public scripts use 0)
    neg_alpha: float = number(0.1, ge=0)  # weight of the terms on wrong rows (the CPO guide's default)
    mi_alpha: float | None = number(None)  # the CPO guide's key, accepted; no wrapper reads it (a set value logs a warning)
    uncertainty: str = choice("minmax", *UNCERTAINTY_MODES)  # U from entropy: minmax (per row, the public code) | vocab (H / log V, the CPO guide)
    difficulty: str = choice("three", *DIFFICULTY_MODES)  # three (+1/0/-1) | five (-2..+2 by fraction correct) | variance (reward variance)
    variance_low: float = number(0.1, ge=0)  # difficulty=variance: group reward variance below this is +1 (easy)
    variance_high: float = number(0.5, ge=0)  # difficulty=variance: group reward variance above this is -1 (hard)
    hint: HintConfig = field(default_factory=HintConfig)  # hint placement (data/hints.py)

    def __post_init__(self) -> None:
        if self.variance_low > self.variance_high:
            raise ValueError(f"cpo.variance_low ({self.variance_low}) must be <= cpo.variance_high "
                             f"({self.variance_high})")


@dataclass
class AdvantageConfig:
    """How rewards are normalised: within a prompt group (grpo, mtpo_segments) or over the batch (REINFORCE++)."""

    use_std: bool = True  # divide by the std (grpo: the group's; reinforce_plus_plus*: the batch's); false = mean-centring only (Dr.GRPO)
    std_floor: float = number(1e-4, gt=0)  # lower bound of that std, in reward units (see module docstring)


def check_group_size(cfg) -> None:
    """rollout.n against the built-in estimator's `min_group_size` (from the generated table, so that
    `load_config`, and with it `aligner-ext config`, refuses it without importing the estimator)."""
    name = cfg.algorithm.adv_estimator
    needed = MIN_GROUP_SIZE.get(name, 1)
    if cfg.rollout.n < needed:
        raise ValueError(f"rollout.n={cfg.rollout.n}: algorithm.adv_estimator={name} normalises rewards within a "
                         f"prompt's group and needs at least {needed} samples per prompt (a group of one has "
                         "advantage 0, so nothing would be trained)")
