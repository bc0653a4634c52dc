"""Errors a user can act on (bad data, a missing model, a corrupt checkpoint, a diverging run).

The CLI prints such an error as one line naming the file, row, field or key, and exits with status
2 (under torchrun every rank exits 2 and rank 0 alone prints it); set ALIGNER_EXT_TRACEBACK=1 to see
the traceback as well. Each class also derives from the
built-in type callers already expect (ValueError, FileNotFoundError, RuntimeError).
"""

from __future__ import annotations

TRACEBACK_ENV = "ALIGNER_EXT_TRACEBACK"


class UserError(Exception):
    """Base of the errors whose message is the whole story (module docstring)."""


class ContractError(UserError, ValueError):
    """A plug-in reads a batch field that no earlier stage of the step writes (trainer/contracts.py)."""


class ModelPathError(UserError, FileNotFoundError):
    """`model.path` does not exist or is not a transformers checkpoint directory."""


class ConfigError(UserError, ValueError):
    """Settings that each validate but cannot work together (the message names them)."""
