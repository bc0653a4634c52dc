"""Hint injection (CPO): the same responses, scored under a prompt that also shows a hint.

The hint is the row's gold solution (the first non-empty of `cpo.hint.solution_fields` in
`extra_info`: `gold_solution`, then `solution` as public CPO data has it; with
`cpo.gold_as_hint`) or its ground truth. It is written into the row's chat messages, which are rendered by the tokenizer's
own chat template exactly as the loader renders prompts (`templating.encode_prompt`), so no token id
is hard-coded and any template works. Three placements:

- `user_prefix` (default, as the original recipe): `prefix_template` ("{hint}\\n") at the start of the last user
  turn's content;
- `reference_prompt` (the public code's current version): the last user turn's content becomes
  `reference_template` with `{question}` (its old content) and `{hint}`;
- `assistant_turn` (the public code's older version): after the last user turn, an assistant turn
  holding the hint and a user turn `followup_template` repeating the question.

This module works on rows and prompt ids; the batch-level pass (hinted prompts of every row,
left-padded to their own width, the same response tensors) is `experience/hint_logprobs.py`.

Decisions:
- A hint longer than the prompt padding widens the batch; it is never cut to fit (the original recipe cuts it
  to the padding silently). It is truncated only when `max_hint_length` > 0, and then by
  `truncate_side`: `left` drops its start and keeps the final answer (as the public code), `right`
  keeps its start (as the original recipe). Truncations are counted.
- For the insertion placements, `check_insertion` requires the hinted prompt's ids to be the
  original prompt's ids with one contiguous run inserted, so the un-hinted prompt is compared token
  for token (a tokenizer that merges the hint's last characters with the following text fails with
  an error naming the row). `reference_prompt` rewrites the turn, so it is not checked.
- The trained prompt must be the rendering of the row's messages; a prompt cut by
  `data.overlong_prompt=truncate_left` is an error (its hinted version would not be comparable).
- A row without a hint is an error naming the row (`missing=error`), or is skipped and counted
  (`missing=skip`): it gets no hinted pass and the CPO wrappers leave its advantages as GRPO's.
  `check_hints` runs over every training row when the run builds, so such a row (or one without a
  user turn to hold the hint) stops the run before its first step, not when a step draws it.
- Templates substitute `{hint}` and `{question}` literally (no `str.format`), so braces such as
  `\\boxed{}` in a template or a hint need no escaping.
"""

from __future__ import annotations

import re

from aligner_ext.data.settings import HintConfig
from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import DataError


PLACEHOLDER = re.compile(r"\{(hint|question)\}")


def hint_text(row: PromptRow, gold_as_hint: bool, solution_fields: list[str]) -> str | None:
    """The row's hint: the first non-empty `extra_info` field of `solution_fields` (gold_as_hint) or its
    ground truth; None if absent or empty."""
    if gold_as_hint:
        value = next((row.extra_info[name] for name in solution_fields if row.extra_info.get(name) not in (None, "")),
                     None)
    else:
        value = row.ground_truth
    if value is None:
        return None
    if isinstance(value, (list, tuple)):  # several accepted answers: the first one is the hint
        value = value[0] if value else None
        if value is None:
            return None
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def fill(template: str, **values: str) -> str:
    """`template` with each `{hint}` / `{question}` replaced literally by its value."""
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def hinted_messages(messages: list[dict[str, str]], hint: str, cfg: HintConfig, row_id: str) -> list[dict[str, str]]:
    """A copy of `messages` with `hint` placed as `cfg.placement` says."""
    users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
    if not users:
        raise DataError(f"row {row_id}: field 'prompt' has no user message to put the CPO hint in")
    last = users[-1]
    question = messages[last]["content"]
    out = [dict(message) for message in messages]
    if cfg.placement == "user_prefix":
        out[last]["content"] = fill(cfg.prefix_template, hint=hint) + question
    elif cfg.placement == "reference_prompt":
        out[last]["content"] = fill(cfg.reference_template, hint=hint, question=question)
    else:
        turns = [{"role": "assistant", "content": hint},
                 {"role": "user", "content": fill(cfg.followup_template, question=question)}]
        out[last + 1:last + 1] = turns
    return out


def truncate_hint(tokenizer, hint: str, cfg: HintConfig) -> tuple[str, bool]:
    """`hint` cut to `cfg.max_hint_length` tokens on `cfg.truncate_side`; (text, whether it was cut)."""
    if cfg.max_hint_length == 0:
        return hint, False
    ids = tokenizer(hint, add_special_tokens=False)["input_ids"]
    if len(ids) <= cfg.max_hint_length:
        return hint, False
    kept = ids[-cfg.max_hint_length:] if cfg.truncate_side == "left" else ids[:cfg.max_hint_length]
    return tokenizer.decode(kept), True


def insertion_point(original: list[int], hinted: list[int]) -> int | None:
    """Index at which `hinted` is `original` with one contiguous run inserted, or None if it is not."""
    if len(hinted) <= len(original):
        return None
    prefix = 0
    while prefix < len(original) and original[prefix] == hinted[prefix]:
        prefix += 1
    suffix = 0
    while suffix < len(original) - prefix and original[-1 - suffix] == hinted[-1 - suffix]:
        suffix += 1
    return prefix if prefix + suffix == len(original) else None


def hinted_prompt_ids(row: PromptRow, original: list[int], tokenizer, cfg: HintConfig,
                      gold_as_hint: bool) -> tuple[list[int] | None, bool]:
    """(hinted prompt ids or None when the row has no hint, whether the hint was truncated)."""
    hint = hint_text(row, gold_as_hint, cfg.solution_fields)
    if hint is None:
        if cfg.missing == "error":
            raise missing_hint([row], 1, cfg, gold_as_hint)
        return None, False
    if encode_prompt(tokenizer, row.messages) != original:
        raise DataError(f"row {row.row_id}: the trained prompt is not the chat-template rendering of its messages "
                        "(cut by data.overlong_prompt=truncate_left?); a hinted prompt could not be compared with it")
    hint, truncated = truncate_hint(tokenizer, hint, cfg)
    hinted = encode_prompt(tokenizer, hinted_messages(row.messages, hint, cfg, row.row_id))
    if cfg.check_insertion and cfg.placement != "reference_prompt" and insertion_point(original, hinted) is None:
        raise DataError(f"row {row.row_id}: the hinted prompt is not the original prompt's tokens with the hint "
                        f"inserted (placement {cfg.placement}): the tokenizer or template changed the surrounding "
                        "tokens; end the hint template with a separator or set cpo.hint.check_insertion=false")
    return hinted, truncated


def missing_hint(rows: list[PromptRow], total: int, cfg: HintConfig, gold_as_hint: bool) -> DataError:
    """The error for `rows` (of `total`), which have no hint, naming the first and the field it is read from."""
    source = ("extra_info." + " / ".join(cfg.solution_fields)) if gold_as_hint else "reward_model.ground_truth"
    count = f" ({len(rows)} of {total} training rows have none)" if total > 1 else ""
    return DataError(f"row {rows[0].row_id}: no {source} to use as the CPO hint (cpo.gold_as_hint={gold_as_hint})"
                     f"{count}; add it or set cpo.hint.missing=skip")


def check_hints(rows: list[PromptRow], cfg: HintConfig, gold_as_hint: bool) -> None:
    """Refuse now what the hint pass would refuse when a step draws the row: a row without a hint
    (`missing=error`) or without a user turn to hold one. Tokenising is left to the pass."""
    missing = []
    for row in rows:
        hint = hint_text(row, gold_as_hint, cfg.solution_fields)
        if hint is None:
            missing.append(row)
        else:
            hinted_messages(row.messages, hint, cfg, row.row_id)
    if missing and cfg.missing == "error":
        raise missing_hint(missing, len(rows), cfg, gold_as_hint)
