"""The prompt stream: rows -> tokenised prompts -> fixed-size batches of `PromptDraw`s, resumable.

`PromptLoader` encodes every prompt once, up front (datasets here are small), and applies the
overlong policy: `error` raises naming the rows and their lengths; `skip` drops them; `truncate_left`
keeps their last `max_prompt_length` tokens (the end of the prompt, which holds the question and the
generation prompt). Skips and truncations are counted in `metrics()` and logged once.

Training draws form one endless stream. Draw k (counting from 0 over the whole run) is row
`order(epoch)[position]` with `epoch, position = divmod(k, num_rows)`, and its `draw_id` is k, so
draw ids are unique, deterministic and equal to `epoch * num_rows + position`. `order(epoch)` is
a permutation seeded by (seed, epoch) when shuffling, the identity otherwise. A batch is the next
`batch_size` draws and may span two epochs. The whole state is the draw counter, so `state_dict`
is tiny and a resumed loader yields exactly the batches the first one would have.

Validation uses `iterate_once()`: one pass in file order, no shuffling, last batch possibly smaller.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np
from jinja2 import TemplateError

from aligner_ext.data.readers import load_files
from aligner_ext.data.settings import DEFAULT_VAL_SET, OVERLONG_POLICIES, DataConfig, check_val_set_names
from aligner_ext.data.tasks import TASKS, builtin_rows
from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.errors import DataError

logger = logging.getLogger(__name__)

def load_split(cfg: DataConfig, split: str) -> list[PromptRow]:
    """Rows of `split` ("train" or "val").

    Files win when given. Without val files, validation uses the built-in task's val split only
    when training also uses the built-in task; with user train files it returns [] (no validation),
    since a built-in task would not match the user's data.
    """
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'val'")
    files = cfg.train_files if split == "train" else cfg.val_files
    if files:
        return load_files(list(files))
    size = cfg.builtin_train_size if split == "train" else cfg.builtin_val_size
    if split == "val" and (cfg.train_files or size == 0):
        return []
    return builtin_rows(cfg.builtin_task, split, size, cfg.seed)


def build_loader(cfg: DataConfig, tokenizer, split: str) -> "PromptLoader | None":
    """The loader of `split` with its batch size and shuffling from `cfg`; None when it has no rows."""
    rows = load_split(cfg, split)
    if not rows:
        return None
    if split == "train":
        return PromptLoader(rows, tokenizer, cfg, cfg.train_batch_size, cfg.shuffle)
    return PromptLoader(rows, tokenizer, cfg, cfg.val_batch_size, shuffle=False)


def build_val_loaders(cfg: DataConfig, tokenizer, names: list[str]) -> dict[str, "PromptLoader"]:
    """The validation sets to evaluate, by name: the sets of `cfg.val_sets` listed in `names` (all of them when
    `names` is empty), or else the one set of `load_split(cfg, "val")`, named DEFAULT_VAL_SET; {} when
    there is no validation data. An entry of a set that names a built-in task gives that task's val split
    (`builtin_val_size` rows); any other entry is a data file."""
    check_val_set_names(cfg, names)
    if not cfg.val_sets:
        loader = build_loader(cfg, tokenizer, "val")
        return {} if loader is None else {DEFAULT_VAL_SET: loader}
    loaders = {}
    for name, entries in cfg.val_sets.items():
        if names and name not in names:
            continue
        rows = []
        for entry in entries:
            rows += (builtin_rows(entry, "val", cfg.builtin_val_size, cfg.seed) if entry in TASKS
                     else load_files([entry]))
        loaders[name] = PromptLoader(rows, tokenizer, cfg, cfg.val_batch_size, shuffle=False)
    return loaders


class PromptLoader:
    """Tokenised prompts served as an endless, resumable stream of fixed-size batches."""

    def __init__(self, rows: list[PromptRow], tokenizer, cfg: DataConfig, batch_size: int, shuffle: bool):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if not rows:
            raise ValueError("PromptLoader got an empty dataset (no rows)")
        self.cfg = cfg
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.num_skipped_overlong = 0
        self.num_truncated_overlong = 0
        self._rows, self._prompt_ids = self._encode_all(rows, tokenizer)
        self._draws = 0  # draws served so far over the whole run: the loader's entire state
        self._order_cache: tuple[int, list[int]] = (-1, [])

    @property
    def rows(self) -> list[PromptRow]:
        """The rows served (after the overlong-prompt policy)."""
        return self._rows

    @property
    def prompt_lengths(self) -> list[int]:
        """Tokens of each served prompt, chat template included."""
        return [len(ids) for ids in self._prompt_ids]

    def __len__(self) -> int:
        """Rows kept after the overlong policy."""
        return len(self._rows)

    @property
    def epoch(self) -> int:
        """Epoch of the next draw (completed passes over the rows)."""
        return self._draws // len(self._rows)

    @property
    def position(self) -> int:
        """Position of the next draw within its epoch."""
        return self._draws % len(self._rows)

    def next_batch(self, count: int | None = None) -> list[PromptDraw]:
        """The next `count` (default `batch_size`) draws of the stream, crossing epoch boundaries."""
        batch = []
        for _ in range(self.batch_size if count is None else count):
            epoch, position = divmod(self._draws, len(self._rows))
            index = self._order(epoch)[position]
            batch.append(PromptDraw(self._rows[index], list(self._prompt_ids[index]), draw_id=self._draws))
            self._draws += 1
        return batch

    def iterate_once(self) -> Iterator[list[PromptDraw]]:
        """One pass in row order without shuffling; draw_id is the row's index in the pass.

        Leaves the training stream untouched.
        """
        for start in range(0, len(self._rows), self.batch_size):
            indices = range(start, min(start + self.batch_size, len(self._rows)))
            yield [PromptDraw(self._rows[i], list(self._prompt_ids[i]), draw_id=i) for i in indices]

    def metrics(self) -> dict[str, float]:
        return {
            "data/epoch": float(self.epoch),
            "data/num_skipped_overlong": float(self.num_skipped_overlong),
            "data/num_truncated_overlong": float(self.num_truncated_overlong),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws, "num_rows": len(self._rows), "seed": self.cfg.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream where `state` left it; the rows, seed and shuffling must match."""
        mine = self.state_dict()
        for key in ("num_rows", "seed", "shuffle"):
            if state[key] != mine[key]:
                raise DataError(f"cannot resume the prompt stream: the saved state has {key}={state[key]!r}, "
                                f"this loader has {key}={mine[key]!r}: the training data, data.seed or "
                                "data.shuffle changed since the checkpoint; restore them, or give this run its own "
                                "trainer.run_name")
        self._draws = int(state["draws"])

    def _order(self, epoch: int) -> list[int]:
        """Row order of `epoch`: a permutation seeded by (seed, epoch), or file order."""
        if self._order_cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self._rows)).tolist()
            else:
                order = list(range(len(self._rows)))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _encode_all(self, rows: list[PromptRow], tokenizer) -> tuple[list[PromptRow], list[list[int]]]:
        """Encode every prompt and apply `cfg.overlong_prompt`; returns the kept rows and their ids."""
        limit, policy = self.cfg.max_prompt_length, self.cfg.overlong_prompt
        if policy not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong_prompt must be one of {', '.join(OVERLONG_POLICIES)}; got {policy!r}")
        kept_rows, kept_ids, overlong = [], [], []
        for row in rows:
            try:
                ids = encode_prompt(tokenizer, row.messages)
            except TemplateError as err:  # e.g. a template that requires alternating user / assistant turns
                raise DataError(f"row {row.row_id}: field 'prompt': the tokenizer's chat template refuses these "
                                f"messages ({type(err).__name__}: {err})") from err
            if len(ids) > limit:
                overlong.append(f"row {row.row_id} ({len(ids)} tokens)")
                if policy == "skip":
                    continue
                ids = ids[-limit:]
            kept_rows.append(row)
            kept_ids.append(ids)
        if overlong:
            summary = (f"{len(overlong)} of {len(rows)} prompts (field 'prompt', chat template included) are longer "
                       f"than data.max_prompt_length={limit} tokens, e.g. {', '.join(overlong[:3])}")
            if policy == "error":
                raise DataError(f"{summary}; set data.overlong_prompt to skip or truncate_left, "
                                "or raise data.max_prompt_length")
            if policy == "skip":
                self.num_skipped_overlong = len(overlong)
                logger.warning("%s: skipped them (data.overlong_prompt=skip)", summary)
            else:
                self.num_truncated_overlong = len(overlong)
                logger.warning("%s: kept their last %d tokens (data.overlong_prompt=truncate_left)", summary, limit)
        if not kept_rows:
            raise DataError(f"no prompts left: all {len(rows)} are longer than data.max_prompt_length={limit}")
        return kept_rows, kept_ids
