"""Rules on single settings, declared on the field they check.

A config dataclass declares a field's allowed values where it declares the field:

    lr: float = number(1e-6, gt=0)  # peak learning rate
    schedule: str = choice("constant", "constant", "linear", "cosine")  # ...
    loss: str = plugin("clipped_pg", "aligner_ext.losses.base:LOSSES")  # ...

`check_settings` walks a config tree and refuses the first value outside its field's rule with one
line naming the dotted key, the allowed values and the value given (a did-you-mean for names).
Every number must be finite; a numeric field without a rule still gets that check, and the schema
test (tests/unit/config/test_setting_rules.py) requires every numeric field to declare its range,
so a new option cannot forget its check. The configuration reference prints each rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from typing import Any

from aligner_ext.plugin_names import BUILTIN_PLUGINS, KINDS

RULE = "aligner_ext.rule"  # the dataclass field metadata key holding a field's rule


class Rule:
    """What values a setting admits: `problem` says what is wrong with one, or None."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError

    def describe(self) -> str:
        """The allowed values, for messages and the configuration reference."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Range(Rule):
    """A finite number within optional bounds; `optional`: None is allowed too (an unset setting)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problem(self, value: Any) -> str | None:
        return self.describe() if self.outside(value) else None

    def outside(self, value: Any) -> bool:
        """Whether `value` is not a finite number within the bounds (None is within: an unset setting)."""
        if value is None:
            return False
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return True
        return ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt))

    def describe(self) -> str:
        bounds = [f"{sign} {_short(bound)}" for sign, bound in
                  ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)) if bound is not None]
        return "a finite number" + (" " + " and ".join(bounds) if bounds else "")


@dataclasses.dataclass(frozen=True)
class EachInRange(Range):
    """A list of finite numbers, each within the bounds (a lone number is judged as one number)."""

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return Range.describe(self) if self.outside(value) else None
        bad = [item for item in value if self.outside(item)]
        return f"{self.describe()}; {_short(bad[0])} is not" if bad else None

    def describe(self) -> str:
        return "a list, each item " + Range.describe(self)


@dataclasses.dataclass(frozen=True)
class OneOf(Rule):
    """One of a fixed set of names."""

    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        return None if value in self.choices else self.describe() + _did_you_mean(value, self.choices)

    def describe(self) -> str:
        return "one of " + ", ".join(self.choices)


@dataclasses.dataclass(frozen=True)
class Registered(Rule):
    """A name in a plug-in registry (`module:ATTRIBUTE`, read when checked), one of `extra`, or a dotted
    path `pkg.module:attr` to user code (imported when the run builds, not here). `many`: a list of such."""

    registry: str
    extra: tuple[str, ...] = ()
    many: bool = False

    def problem(self, value: Any) -> str | None:
        for name in (value if self.many else [value]):
            if name in self.extra or "." in name or ":" in name or name in self._names() or self._registered(name):
                continue
            return f"{self.describe()}; {name!r} is not one" + _did_you_mean(name, self._names())
        return None

    def describe(self) -> str:
        kind = KINDS[self.registry]
        what = f"a list of {kind} names" if self.many else f"a {kind} name"
        return f"{what} ({', '.join(self._names())}) or a dotted path pkg.module:attr"

    def _names(self) -> list[str]:
        """`extra` and the built-in names, from the generated table (no plug-in module is imported)."""
        return [*self.extra, *BUILTIN_PLUGINS[self.registry]]

    def _registered(self, name: str) -> bool:
        """A plug-in registered at run time, in a registry whose module is loaded already (accepted, not listed)."""
        module, _, attribute = self.registry.partition(":")
        return module in sys.modules and name in getattr(sys.modules[module], attribute)


def number(default: float | int | None, *, ge=None, gt=None, le=None, lt=None) -> Any:
    """A numeric field admitting finite values within the bounds (and None when `default` is None)."""
    return dataclasses.field(default=default, metadata={RULE: Range(ge=ge, gt=gt, le=le, lt=lt)})


def numbers(default: list[int | float], *, ge=None, gt=None, le=None, lt=None) -> Any:
    """A list field of numbers, each admitting finite values within the bounds."""
    return dataclasses.field(default_factory=lambda: list(default),
                             metadata={RULE: EachInRange(ge=ge, gt=gt, le=le, lt=lt)})


def choice(default: str, *choices: str) -> Any:
    """A string field admitting one of `choices`."""
    return dataclasses.field(default=default, metadata={RULE: OneOf(tuple(choices))})


def plugin(default: str, registry: str, *extra: str) -> Any:
    """A plug-in name of `registry` ("module:ATTRIBUTE"), or one of `extra` (e.g. "auto")."""
    return dataclasses.field(default=default, metadata={RULE: Registered(registry, tuple(extra))})


def plugins(default: list[str], registry: str) -> Any:
    """A list of plug-in names of `registry`."""
    return dataclasses.field(default_factory=lambda: list(default), metadata={RULE: Registered(registry, many=True)})


def rule_of(field: dataclasses.Field) -> Rule | None:
    return field.metadata.get(RULE)


def check_settings(config: Any, prefix: str = "") -> None:
    """Refuse the first setting of the dataclass tree `config` outside its field's rule (ValueError,
    one line naming the key); a number without a rule must still be finite."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            check_settings(value, key + ".")
            continue
        rule = rule_of(field)
        if rule is None and isinstance(value, float) and not math.isfinite(value):
            rule = Range()
        problem = rule.problem(value) if rule is not None else None
        if problem is not None:
            raise ValueError(f"{key}={_short(value)}: must be {problem}")


def _did_you_mean(name: Any, known) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(value: Any) -> str:
    """A number as a reader writes it (1e-06, 0.5, 2097152), anything else as repr."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
