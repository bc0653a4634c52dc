"""The CPO advantage wrappers: each shapes GRPO advantages token by token from the hint's effect.

Every wrapper is `fn(adv, s) -> adv` on [B, R] float64 advantages and the quantities in `Shaping`
(built by `algorithms/cpo.py`), registered by the name `cpo.wrap_method` takes. Notation:
m = response tokens of rows that got a hint; c = the row is correct; D = its group's difficulty
(D > 0 easy, D < 0 hard, 0 mixed); H entropy, U uncertainty in [0, 1]; Δ = lp_hint - lp;
MI = exp(lp_hint)·Δ; ratio = clamp(exp(Δ), 1/λ, λ); kl_mean and Ū are row means over the response.
"sign-clamp" sets A = max(A, 0) on correct rows and A = min(A, 0) on wrong rows (tokens in m).

| name (aliases) | update, on tokens in m |
| --- | --- |
| none | no change (the hint pass only feeds the metrics) |
| naive | P = ratio>=λ, p_hint>0.1: A += pos·H; N = ratio<=1/λ, p_old>0.1: A -= neg·(max_row H - H) |
| naive_qwen3 (naive_accmask) | naive with P on correct and N on wrong rows only, then sign-clamp |
| noaccmask (_qwen3) | naive, then sign-clamp |
| mi (_qwen3) | MI>=0: A += pos·MI·U; MI<0: A += neg·MI·(1-U); sign-clamp |
| mi_accmask (_qwen3) | MI>=0, c: A += pos·MI·(1+U); MI<0, wrong: A += neg·MI·(2-U); sign-clamp |
| mi_unify (_qwen3) | c: A += pos·MI·(1-U); wrong: A += neg·MI·(1-U); sign-clamp |
| mi_clamp_unify (_qwen3) | mi_unify with MI = min(MI, 10) |
| mi_clamp_unify_difficulty (_qwen3) | MI = min(MI, 10); D != 0: A += pos·MI·(1-U); D = 0: A += neg·MI·(1-U) |
| mi3 (_qwen3) | c: A += pos·U; wrong: MI>=0: A += neg·MI·U, MI<0: A += neg·MI·(1-U) |
| negonly_mi3 (_qwen3) | mi3 with the wrong-row terms only where D < 0 |
| negonly_mi (_qwen3) | c: A += pos·U; wrong, D < 0: A += neg·MI |
| reverse_mi3 (_qwen3) | mi3 with the wrong-row terms subtracted |
| addition_mi3 (_qwen3) | mi3 without the MI<0 term |
| mi2 (_qwen3) | c: A += pos·U; wrong: A += neg·MI |
| negonly_seq_kl (_qwen3) | c: A += pos·kl_mean; wrong, D < 0: A += neg·kl_mean |
| seq_kl (_qwen3) | c, D>0: A += pos·Ū; c, D<=0: A += max(pos·Ū, -abs(A)/2); |
|                 | wrong, D<0: A += neg·kl_mean; wrong, D>=0: A += min(neg·kl_mean, abs(A)/2) |
| negonly_tok_kl (_qwen3) | Δc = clamp(Δ, -10, 10); c: A += pos·U; wrong, D < 0: A += neg·Δc |
| tok_kl (_qwen3) | negonly_tok_kl plus wrong, D >= 0: A += min(neg·Δc, abs(A)/2) |

Formulas are those of the public implementation (26hzhang/verl `verl/cpo/cpo_advantage_wrapper.py`).
Decisions (docs/variants/cpo.md has all of them):
- `_qwen3` names are aliases, except `naive_qwen3`, which differs from `naive` (correctness gating
  and sign-clamp) and is also `naive_accmask`.
- c and "wrong" come from the raw outcome (`batch.correct`), so 0/1 rewards work like the public
  code's +-1 rewards; "c != +1" and "c = -1" are then the same set.
- D tests use its sign, so the 5-level and variance difficulty scales drive the same branches.
- `naive`'s max_row H runs over the row's response tokens (the public code includes padding).
- `tok_kl` is the public code's 18th wrapper without its dispatch bug (naive applied on top).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aligner_ext.registry import Registry

CPO_WRAPPERS = Registry("cpo advantage wrapper")
MI_CLAMP = 10.0  # upper bound of MI in the mi_clamp_* wrappers
DELTA_CLAMP = 10.0  # bound of |Δ| in the tok_kl wrappers
PROB_FLOOR = 0.1  # naive family: a token must have this probability (hinted for P, plain for N)

Wrapper = Callable[[torch.Tensor, "Shaping"], torch.Tensor]


@dataclass(frozen=True)
class Shaping:
    """What the wrappers read. Token tensors are [B, R] float64, row tensors [B, 1]."""

    mask: torch.Tensor  # [B, R] bool: response tokens (loss mask) of rows that got a hint
    delta: torch.Tensor  # lp_hint - lp
    mi: torch.Tensor  # exp(lp_hint) * delta
    ratio: torch.Tensor  # exp(delta) clamped to [1/cpo_lambda, cpo_lambda]
    p_hint: torch.Tensor  # exp(lp_hint)
    p_old: torch.Tensor  # exp(lp)
    entropy: torch.Tensor  # H, nats
    uncertainty: torch.Tensor  # U in [0, 1]
    entropy_max: torch.Tensor  # [B, 1] max of H over the row's response tokens
    entropy_mean: torch.Tensor  # [B, 1] Ū: mean H over the row's response tokens, nats
    kl_mean: torch.Tensor  # [B, 1] mean delta over the row's response tokens
    correct: torch.Tensor  # [B, 1] bool: the row's raw outcome is correct
    difficulty: torch.Tensor  # [B, 1] int64 group difficulty
    pos_alpha: float  # weight of the correct-row (positive) terms
    neg_alpha: float  # weight of the wrong-row (negative) terms
    cpo_lambda: float  # ratio clamp bound (> 1)

    @property
    def wrong(self) -> torch.Tensor:
        return ~self.correct

    @property
    def easy(self) -> torch.Tensor:
        return self.difficulty > 0

    @property
    def hard(self) -> torch.Tensor:
        return self.difficulty < 0


def add(adv: torch.Tensor, where: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """adv + value where `where` is True (broadcast), adv elsewhere."""
    return torch.where(where, adv + value, adv)


def sign_clamp(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    """A >= 0 on correct rows' tokens and A <= 0 on wrong rows' tokens (within m)."""
    adv = torch.where(s.mask & s.correct, adv.clamp(min=0), adv)
    return torch.where(s.mask & s.wrong, adv.clamp(max=0), adv)


@CPO_WRAPPERS.register("none")
def none(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return adv


def _naive_sets(s: Shaping) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, N): tokens the hint made lambda times likelier / unlikelier, with the probability floors."""
    pos = s.mask & (s.ratio >= s.cpo_lambda) & (s.p_hint > PROB_FLOOR)
    neg = s.mask & (s.ratio <= 1.0 / s.cpo_lambda) & (s.p_old > PROB_FLOOR)
    return pos, neg


def _naive_update(adv: torch.Tensor, s: Shaping, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    adv = add(adv, pos, s.pos_alpha * s.entropy)
    return add(adv, neg, -s.neg_alpha * (s.entropy_max - s.entropy))


@CPO_WRAPPERS.register("naive")
def naive(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _naive_update(adv, s, *_naive_sets(s))


@CPO_WRAPPERS.register("naive_qwen3", "naive_accmask")
def naive_accmask(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    pos, neg = _naive_sets(s)
    return sign_clamp(_naive_update(adv, s, pos & s.correct, neg & s.wrong), s)


@CPO_WRAPPERS.register("noaccmask", "noaccmask_qwen3")
def noaccmask(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return sign_clamp(_naive_update(adv, s, *_naive_sets(s)), s)


@CPO_WRAPPERS.register("mi", "mi_qwen3")
def mi(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    rising = s.mi >= 0
    adv = add(adv, s.mask & rising, s.pos_alpha * s.mi * s.uncertainty)
    adv = add(adv, s.mask & ~rising, s.neg_alpha * s.mi * (1 - s.uncertainty))
    return sign_clamp(adv, s)


@CPO_WRAPPERS.register("mi_accmask", "mi_accmask_qwen3")
def mi_accmask(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    rising = s.mi >= 0
    adv = add(adv, s.mask & rising & s.correct, s.pos_alpha * s.mi * (1 + s.uncertainty))
    adv = add(adv, s.mask & ~rising & s.wrong, s.neg_alpha * s.mi * (2 - s.uncertainty))
    return sign_clamp(adv, s)


def _unify(adv: torch.Tensor, s: Shaping, mi_values: torch.Tensor) -> torch.Tensor:
    adv = add(adv, s.mask & s.correct, s.pos_alpha * mi_values * (1 - s.uncertainty))
    adv = add(adv, s.mask & s.wrong, s.neg_alpha * mi_values * (1 - s.uncertainty))
    return sign_clamp(adv, s)


@CPO_WRAPPERS.register("mi_unify", "mi_unify_qwen3")
def mi_unify(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _unify(adv, s, s.mi)


@CPO_WRAPPERS.register("mi_clamp_unify", "mi_clamp_unify_qwen3")
def mi_clamp_unify(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _unify(adv, s, s.mi.clamp(max=MI_CLAMP))


@CPO_WRAPPERS.register("mi_clamp_unify_difficulty", "mi_clamp_unify_difficulty_qwen3")
def mi_clamp_unify_difficulty(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    clamped = s.mi.clamp(max=MI_CLAMP)
    settled = s.difficulty != 0  # the group all agrees (or leans, on the 5-level scale)
    adv = add(adv, s.mask & settled, s.pos_alpha * clamped * (1 - s.uncertainty))
    return add(adv, s.mask & ~settled, s.neg_alpha * clamped * (1 - s.uncertainty))


def _mi3(adv: torch.Tensor, s: Shaping, negative: torch.Tensor, sign: float, with_falling: bool) -> torch.Tensor:
    """c: A += pos·U; `negative` rows: A += sign·neg·MI·U (MI >= 0) and, if asked, sign·neg·MI·(1-U) (MI < 0)."""
    adv = add(adv, s.mask & s.correct, s.pos_alpha * s.uncertainty)
    rising = s.mi >= 0
    adv = add(adv, s.mask & negative & rising, sign * s.neg_alpha * s.mi * s.uncertainty)
    if with_falling:
        adv = add(adv, s.mask & negative & ~rising, sign * s.neg_alpha * s.mi * (1 - s.uncertainty))
    return adv


@CPO_WRAPPERS.register("mi3", "mi3_qwen3")
def mi3(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _mi3(adv, s, s.wrong, 1.0, with_falling=True)


@CPO_WRAPPERS.register("negonly_mi3", "negonly_mi3_qwen3")
def negonly_mi3(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _mi3(adv, s, s.wrong & s.hard, 1.0, with_falling=True)


@CPO_WRAPPERS.register("reverse_mi3", "reverse_mi3_qwen3")
def reverse_mi3(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _mi3(adv, s, s.wrong, -1.0, with_falling=True)


@CPO_WRAPPERS.register("addition_mi3", "addition_mi3_qwen3")
def addition_mi3(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _mi3(adv, s, s.wrong, 1.0, with_falling=False)


def _uncertainty_and(adv: torch.Tensor, s: Shaping, negative: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """c: A += pos·U; `negative` rows: A += neg·value."""
    adv = add(adv, s.mask & s.correct, s.pos_alpha * s.uncertainty)
    return add(adv, s.mask & negative, s.neg_alpha * value)


@CPO_WRAPPERS.register("negonly_mi", "negonly_mi_qwen3")
def negonly_mi(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _uncertainty_and(adv, s, s.wrong & s.hard, s.mi)


@CPO_WRAPPERS.register("mi2", "mi2_qwen3")
def mi2(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _uncertainty_and(adv, s, s.wrong, s.mi)


@CPO_WRAPPERS.register("negonly_tok_kl", "negonly_tok_kl_qwen3")
def negonly_tok_kl(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    return _uncertainty_and(adv, s, s.wrong & s.hard, s.delta.clamp(-DELTA_CLAMP, DELTA_CLAMP))


@CPO_WRAPPERS.register("tok_kl", "tok_kl_qwen3")
def tok_kl(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    delta = s.delta.clamp(-DELTA_CLAMP, DELTA_CLAMP)
    adv = _uncertainty_and(adv, s, s.wrong & s.hard, delta)
    return add(adv, s.mask & s.wrong & ~s.hard, torch.minimum(s.neg_alpha * delta, adv.abs() / 2))


@CPO_WRAPPERS.register("negonly_seq_kl", "negonly_seq_kl_qwen3")
def negonly_seq_kl(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    adv = add(adv, s.mask & s.correct, s.pos_alpha * s.kl_mean)
    return add(adv, s.mask & s.wrong & s.hard, s.neg_alpha * s.kl_mean)


@CPO_WRAPPERS.register("seq_kl", "seq_kl_qwen3")
def seq_kl(adv: torch.Tensor, s: Shaping) -> torch.Tensor:
    """Outside the settled groups a term may move A toward zero by at most half of |A|."""
    adv = add(adv, s.mask & s.correct & s.easy, s.pos_alpha * s.entropy_mean)
    adv = add(adv, s.mask & s.correct & ~s.easy, torch.maximum(s.pos_alpha * s.entropy_mean, -adv.abs() / 2))
    adv = add(adv, s.mask & s.wrong & s.hard, s.neg_alpha * s.kl_mean)
    return add(adv, s.mask & s.wrong & ~s.hard, torch.minimum(s.neg_alpha * s.kl_mean, adv.abs() / 2))
