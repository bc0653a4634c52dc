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


class DataError(UserError, ValueError):
    """A dataset file or row cannot be used: malformed, too long for data.max_prompt_length, or without
    what the run needs from it (a CPO hint); the message names the file, the row and the field."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used: it does not fit the model, or it holds objects that could run code."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file holds pickled objects that could run code if loaded (the message names the file)."""


class UnverifiedCheckpoint(CheckpointError):
    """A checkpoint has no manifest, so nothing shows its files are the ones written; not a fallback
    case like CorruptCheckpoint, since deleting the manifest is how the check would be switched off."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file is missing, truncated or corrupted (the message names it); a resume falls
    back to the previous complete checkpoint."""


class DiskSpaceError(UserError, OSError):
    """The run's checkpoints cannot fit in the free space of trainer.output_dir's filesystem, or a save or
    export failed to write there (disk full, an I/O error); the message names the path and the sizes."""


def error_line(err: BaseException) -> str:
    """One line of `err`: for torch's weights-only refusal (paragraphs) the line naming the refused global."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    refused = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    if refused:
        return refused[0].removeprefix("WeightsUnpickler error:").strip().split(". ")[0]
    return lines[0] if lines else type(err).__name__
