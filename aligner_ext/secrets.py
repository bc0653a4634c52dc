"""Secrets in the configuration (API keys, tokens): where they are read from, and what is written of them.

A secret setting is one whose name ends in `api_key`, `token`, `secret` or `password`
(`generator.remote.api_key`, `serve.api_key`). Its value comes from the first of these that is given:
1. from the setting itself (a command-line override; meant for trying things out: it is visible in
   the process list and shell history);
2. from the environment variable named by its `<name>_env` setting;
3. from the first line of the file named by its `<name>_file` setting (e.g. a mounted secret).
The value is never written: every serialisation of the config (`config.yaml`, the config inside each
checkpoint's trainer state, the trackers' parameters, `aligner-ext config`) goes through `redact`, which
records only that one was set (`SET`). A resumed run re-reads it from the environment or the file, as
the first run did: the saved config cannot give it back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from aligner_ext.errors import UserError

SET = "<set>"  # what a serialised config says of a secret that has a value
_SECRET_NAME = re.compile(r"(api_key|token|secret|password)$")


class SecretError(UserError, ValueError):
    """A secret's environment variable or file was named but gives no value."""


def is_secret(name: str) -> bool:
    """Whether a setting (its last dotted name) holds a secret."""
    return bool(_SECRET_NAME.search(name.rsplit(".", 1)[-1]))


def redact(tree):
    """A config tree (nested dicts and lists, as `OmegaConf.to_container` gives) with every set secret
    replaced by `SET`; unset ones stay None, so a reader still sees whether one was given."""
    if isinstance(tree, dict):
        return {key: SET if is_secret(str(key)) and value is not None else redact(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [redact(item) for item in tree]
    return tree


def read_secret(value: str | None, env: str | None, file: str | None, name: str) -> str | None:
    """The secret `name` from its value, else the environment variable `env`, else the file `file`
    (module docstring); None when none is given. A named variable that is unset or empty, or a named file
    that is missing or empty, is a SecretError: a run would otherwise go on without the key it was given."""
    if value is not None:
        return value
    if env:
        secret = os.environ.get(env, "").strip()
        if not secret:
            raise SecretError(f"{name}_env={env}: the environment variable {env} is unset or empty")
        return secret
    if file:
        path = Path(file).expanduser()
        try:
            secret = path.read_text().strip().splitlines()
        except OSError as err:
            raise SecretError(f"{name}_file={file}: cannot read it: {err.strerror}") from err
        if not secret:
            raise SecretError(f"{name}_file={file}: the file is empty")
        return secret[0].strip()
    return None
