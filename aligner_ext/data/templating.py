"""Chat-template encoding of prompts, and left / right padding into tensors.

`encode_prompt` renders the tokenizer's own chat template to text (with the generation prompt),
then tokenises that text without adding special tokens: the template already wrote them. Rendering
first and tokenising second works the same for every template and every transformers version
(transformers 5 returns a dict from `apply_chat_template(tokenize=True)`), and hard-codes no token ids.

Padding follows `ExperienceBatch`: prompts are left-padded so they all end at the same column,
responses right-padded so they all start at the same column.
"""

from __future__ import annotations

import torch

from aligner_ext.errors import ConfigError


def encode_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` (offered `tools`, JSON schemas, when given) under the tokenizer's chat
    template, ending with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')!r}) has no chat "
            "template; use a chat/instruct checkpoint as model.path, "
            "or add a chat template to its tokenizer"
        )
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def left_pad(seqs: list[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad on the left to the longest sequence, rounded up to a multiple of `multiple`.

    Returns:
        ids: [B, P] int64, pads first then the sequence.
        mask: [B, P] bool, True on real tokens.
    """
    return _pad(seqs, pad_id, left=True, multiple=multiple)


def right_pad(seqs: list[list[int]], pad_id: int, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad on the right to the longest sequence (width 0 when all are empty).

    Returns:
        ids: [B, R] `dtype` (int64 for token ids; float32 for per-token values), the sequence then pads.
        mask: [B, R] bool, True on real entries.
    """
    return _pad(seqs, pad_id, left=False, dtype=dtype)


def _pad(seqs: list[list[int]], pad_id: int, left: bool, dtype: torch.dtype = torch.long,
         multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(seq) for seq in seqs), default=0)
    width += -width % multiple
    ids = torch.full((len(seqs), width), pad_id, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, seq in enumerate(seqs):
        if not seq:
            continue
        columns = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, columns] = torch.as_tensor(seq, dtype=dtype)
        mask[row, columns] = True
    return ids, mask
