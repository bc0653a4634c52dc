"""Name -> class/function registries for every plug-in kind.

Plug-ins register themselves with a decorator; `trainer/build.py` turns config names into objects.
A name containing a dot that is not registered is imported as `package.module:attr` or
`package.module.attr`, so user code outside the package plugs in the same way.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


class Registry:
    """A named table of plug-ins of one kind (experience maker, loss, reward, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Any] = {}

    def register(self, name: str, *aliases: str) -> Callable[[Any], Any]:
        def decorator(obj: Any) -> Any:
            for key in (name, *aliases):
                if key in self._entries and self._entries[key] is not obj:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
                self._entries[key] = obj
            return obj

        return decorator

    def get(self, name: str) -> Any:
        if name in self._entries:
            return self._entries[name]
        if "." in name or ":" in name:
            return load_dotted(name)
        known = ", ".join(sorted(self._entries)) or "(none)"
        raise KeyError(f"unknown {self.kind} {name!r}; known: {known}; or give a dotted path 'pkg.module:attr'")

    def name_of(self, obj: Any) -> str | None:
        """The first name `obj` was registered under, or None."""
        return next((key for key, value in self._entries.items() if value is obj), None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def load_dotted(path: str) -> Any:
    """Import `pkg.module:attr` or `pkg.module.attr`, with an error that names what was missing."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"not a dotted path: {path!r} (expected 'pkg.module:attr')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} for {path!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from err
