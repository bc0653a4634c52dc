"""Settings of the losses: the run config's `loss` section (what every policy-gradient loss shares,
clipped_pg's clip range at its top level, GSPO's and CISPO's own clips in their subsections;
losses/policy_gradient.py).

The dataclasses, each field with its rule, are kept free of torch and of the code that uses them:
composing and checking a configuration (`aligner-ext config`, `load_config`) never imports a model
library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aligner_ext.plugin_names import CANONICAL, LOSS_RULES
from aligner_ext.rules import choice, number, plugin

LOSSES = "aligner_ext.losses.base:LOSSES"  # the registry algorithm.loss names
AGG_MODE_NAMES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # losses/aggregation.py
CORRECTIONS = ("none", "token_tis", "sequence_tis", "token_mask", "sequence_mask")  # losses/off_policy.py
TRUNCATING = ("token_tis", "sequence_tis")  # the corrections that read importance_sampling_cap


@dataclass
class GSPOConfig:
    """GSPO's sequence-ratio clip range (loss gspo; the paper's values)."""

    epsilon: float = number(3e-4, ge=0, lt=1)  # the sequence ratio is clipped below at 1 - epsilon (GSPO: 3e-4)
    epsilon_high: float = number(4e-4, ge=0)  # the sequence ratio is clipped above at 1 + epsilon_high (GSPO: 4e-4)


@dataclass
class CISPOConfig:
    """CISPO's importance-weight clip (loss cispo; MiniMax-M1 sets no lower bound)."""

    epsilon: float = number(1.0, ge=0, le=1)  # the weight is clipped below at 1 - epsilon; 1 = no lower clip (the paper)
    epsilon_high: float = number(3.0, ge=0)  # the weight is clipped above at 1 + epsilon_high (the paper tunes it; Tinker's default 3, NeMo-RL's recipe 5)


@dataclass
class LossConfig:
    """The policy loss (algorithm.loss): clip range, aggregation, KL penalty and off-policy correction."""

    epsilon: float = number(0.2, ge=0, lt=1)  # clipped_pg's lower clip: the ratio is clipped below at 1 - epsilon
    epsilon_high: float = number(0.2, ge=0)  # clipped_pg's upper clip: clipped above at 1 + epsilon_high (DAPO: 0.28)
    agg_mode: str = choice("auto", "auto", *AGG_MODE_NAMES)  # token-mean | seq-mean-token-mean | seq-mean-token-sum | auto (the loss's own: token-mean for clipped_pg and cispo, seq-mean-token-mean for gspo, the one it defines)
    kl_coef: float = number(0.0, ge=0)  # beta, weight of the KL(pi || ref) term; 0 disables the reference model
    kl_estimator: str = plugin("k3", "aligner_ext.losses.kl:KL_ESTIMATORS")  # k1 | k2 | k3 (losses/kl.py)
    log_ratio_clamp: float = number(20.0, gt=0)  # |logprob - old_logprob| bound before exp, in nats
    clip_ratio_c: float = number(0.0, ge=0)  # clipped_pg's dual clip: a negative-advantage token's loss is capped at -clip_ratio_c * A (verl: 3.0); 0 disables it
    off_policy_correction: str = choice("none", *CORRECTIONS)  # weight of each token's term by pi_old / pi_gen, pi_gen the engine's log-probs: none | token_tis | sequence_tis (truncated at importance_sampling_cap) | token_mask | sequence_mask (dropped outside [importance_sampling_low, importance_sampling_high]); losses/off_policy.py
    importance_sampling_cap: float = number(0.0, ge=0)  # truncation C of token_tis and sequence_tis (verl / TRL use 2); > 0 with off_policy_correction=none selects token_tis
    importance_sampling_low: float = number(0.5, gt=0, le=1)  # token_mask / sequence_mask drop tokens or sequences whose ratio is below this (IcePop: 0.5)
    importance_sampling_high: float = number(2.0, ge=1)  # token_mask / sequence_mask drop tokens or sequences whose ratio is above this (IcePop: 2)
    max_token_staleness: int | None = number(None, ge=0)  # a sampled token more than this many policy versions behind the proximal policy weighs 0 in the policy-gradient term, kept in the normaliser (docs/async.md); unset: no token is masked for its age
    gspo: GSPOConfig = field(default_factory=GSPOConfig)  # read by algorithm.loss=gspo
    cispo: CISPOConfig = field(default_factory=CISPOConfig)  # read by algorithm.loss=cispo

    def __post_init__(self) -> None:
        problem = correction_problem(correction_mode(self), self.importance_sampling_cap, self.importance_sampling_low,
                                     self.importance_sampling_high)
        if problem is not None:
            raise ValueError(problem)
        if 0 < self.clip_ratio_c <= 1:
            raise ValueError(f"loss.clip_ratio_c must be > 1 (or 0: no dual clip), got {self.clip_ratio_c:g}")


def correction_mode(cfg) -> str:
    """The correction the `loss` section asks for: a cap alone selects token_tis (losses/off_policy.py)."""
    if cfg.off_policy_correction == "none" and cfg.importance_sampling_cap > 0:
        return "token_tis"
    return cfg.off_policy_correction


def correction_problem(mode: str, cap: float, low: float, high: float) -> str | None:
    """Why an off-policy correction cannot run with these settings (one line), or None."""
    if mode in TRUNCATING and cap == 0:
        return (f"loss.off_policy_correction={mode} truncates at loss.importance_sampling_cap, which is {cap:g}: set "
                "it > 0 (verl and TRL use 2)")
    if mode not in TRUNCATING and cap > 0:
        return (f"loss.importance_sampling_cap={cap:g} is read only by token_tis and sequence_tis; "
                f"loss.off_policy_correction={mode} does not truncate")
    if not 0 < low <= 1 <= high:
        return f"loss.importance_sampling_low={low:g} and _high={high:g} must satisfy 0 < low <= 1 <= high"
    return None


def undefined_setting(loss: str, agg_mode: str, correction: str, agg_modes: tuple[str, ...] | list[str],
                      corrections: tuple[str, ...] | list[str], restriction: str) -> str | None:
    """Why `loss` cannot run with this aggregation mode or off-policy correction (one line), or None: the
    refusal the loss makes when it is built, and `resolve_loss_settings` at load for a built-in one."""
    for key, value, defined in (("agg_mode", agg_mode, agg_modes), ("off_policy_correction", correction, corrections)):
        if value not in defined:
            return f"loss.{key}={value} is not defined for loss {loss} ({restriction}); it takes {' | '.join(defined)}"
    return None


def resolve_loss_settings(loss: str, cfg: LossConfig) -> None:
    """At load, for a built-in `loss` (the generated table LOSS_RULES; a plug-in of a dotted path does both
    when it is built): `agg_mode=auto` becomes the loss's own mode, the first it defines, and a mode or
    correction it does not define is refused."""
    name = CANONICAL[LOSSES].get(loss, loss)
    if name not in LOSS_RULES:
        return
    rules = LOSS_RULES[name]
    if cfg.agg_mode == "auto":
        cfg.agg_mode = rules["agg_modes"][0]
    problem = undefined_setting(name, cfg.agg_mode, correction_mode(cfg), rules["agg_modes"], rules["corrections"],
                                rules["restriction"])
    if problem is not None:
        raise ValueError(problem)
