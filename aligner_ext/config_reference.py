"""Renders docs/configuration.md from the config dataclasses, so the reference cannot drift.

Each field's doc is the comment on its line in the dataclass source (`name: type = default  # doc`);
a test fails when docs/configuration.md differs from what this renders.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from aligner_ext.config import RunConfig
from aligner_ext.rules import rule_of

FIELD_LINE = re.compile(r"^\s+(\w+):[^#]*#\s*(.*)$")


def _field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            for line in inspect.getsource(klass).splitlines():
                match = FIELD_LINE.match(line)
                if match:
                    docs[match.group(1)] = match.group(2).strip()
    return docs


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    """(dotted name, dataclass) for `cls` and every nested dataclass field, depth first."""
    found = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            found += _sections(type(value), f"{prefix}.{f.name}" if prefix else f.name)
    return found


def _cell(text: str) -> str:
    """`text` inside a markdown table cell: a bare `|` would end the cell, so it is escaped."""
    return text.replace("|", "\\|")


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `aligner-ext config --reference`; do not edit by hand.",
        "Override any key on the command line (`aligner-ext train rollout.n=4`) or in a YAML file in `conf/`.",
    ]
    for name, cls in _sections(RunConfig, ""):
        if not name:
            continue
        docs = _field_docs(cls)
        rows = []
        for f in dataclasses.fields(cls):
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(value):
                continue
            rule = rule_of(f)
            allowed = rule.describe() if rule is not None else ""
            rows.append(f"| `{name}.{f.name}` | `{_cell(repr(value))}` | {_cell(allowed)} | {_cell(docs.get(f.name, ''))} |")
        if rows:
            summary = (inspect.getdoc(cls) or "").splitlines()[0]
            lines += ["", f"## `{name}`", "", summary, "", "| key | default | allowed | meaning |", "| --- | --- | --- | --- |", *rows]
    return "\n".join(lines)
