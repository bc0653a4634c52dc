"""ExperienceBatch: the one record that flows from the experience maker to the loss.

Layout, for B samples: prompts are left-padded to width P, responses right-padded to width R, so
`input_ids = cat(prompt_ids, response_ids)` puts every response at columns P..P+R-1 and the logits
that predict response token t sit at column P-1+t. Per-sample non-tensor fields travel in
`samples`, aligned with the rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from aligner_ext.data.types import PromptRow

ANSWER_SEGMENT, CONFIDENCE_SEGMENT = 0, 1  # values of ExperienceBatch.segment_ids (MTPO's two rounds)


@dataclass
class SampleInfo:
    """Non-tensor facts about one sample, kept beside its tensor row."""

    row: PromptRow  # the dataset row the prompt came from
    response_text: str = ""  # decoded response (for rewards and logs only; training uses ids)
    finish_reason: str = ""  # "stop" (stop string), "eos", or "length"
    reward_info: dict[str, Any] = field(default_factory=dict)  # what the reward function reported


@dataclass
class ExperienceBatch:
    """Rollouts of one step. Tensor fields share the leading dimension B."""

    prompt_ids: torch.Tensor  # [B, P] int64, left-padded: the prompt the policy trains on
    prompt_mask: torch.Tensor  # [B, P] bool, True on real prompt tokens
    response_ids: torch.Tensor  # [B, R] int64, right-padded
    response_valid: torch.Tensor  # [B, R] bool, True on generated tokens (right padding False)
    response_mask: torch.Tensor  # [B, R] bool, True on tokens that count in the loss (subset of valid)
    group_ids: torch.Tensor  # [B] int64: samples of one prompt draw share it (never inferred from tokens)
    samples: list[SampleInfo]  # [B] non-tensor fields
    rewards: torch.Tensor | None = None  # [B] float32 sequence reward
    correct: torch.Tensor | None = None  # [B] float32 raw outcome: 1 correct, 0 not (before any shaping)
    token_rewards: torch.Tensor | None = None  # [B, R] float32, the reward on the last response token
    generation_logprobs: torch.Tensor | None = None  # [B, R] float32 from the engine, if it returned them
    old_logprobs: torch.Tensor | None = None  # [B, R] float32 policy log-probs before the update
    ref_logprobs: torch.Tensor | None = None  # [B, R] float32 reference-policy log-probs (KL)
    advantages: torch.Tensor | None = None  # [B, R] float32 per-token advantages
    # MTPO two-round rollouts (experience/two_round.py); None for single-round makers
    answer_group_ids: torch.Tensor | None = None  # [B] int64: samples continuing one round-1 answer share it (nested in group_ids)
    segment_ids: torch.Tensor | None = None  # [B, R] int64: ANSWER_SEGMENT on round-1 tokens, CONFIDENCE_SEGMENT on round-2 tokens; undefined where response_valid is False
    answer_rewards: torch.Tensor | None = None  # [B] float32: answer-side reward of the sample's round-1 answer
    confidence_rewards: torch.Tensor | None = None  # [B] float32: confidence-side reward of the sample's round-2 continuation
    hint_logprobs: torch.Tensor | None = None  # [B, R] float32 log-probs of the response under a hinted prompt (CPO)
    has_hint: torch.Tensor | None = None  # [B] bool, True on rows that got a hint (hint_logprobs is 0 on the others)
    entropy: torch.Tensor | None = None  # [B, R] float32 policy entropy per response token before the update, nats

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64: generated tokens per sample (real response tokens, loss-masked or not)."""
        return self.response_valid.sum(dim=1)

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P+R] prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P+R] int64, 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.response_valid], dim=1).long()

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, P+R] positions counted over real tokens only, so left padding does not shift them."""
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    def select(self, index: Sequence[int] | torch.Tensor) -> "ExperienceBatch":
        """Rows `index`, every field (tensor or not) kept aligned."""
        index = torch.as_tensor(index, dtype=torch.long)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                values[f.name] = value[index]
            elif isinstance(value, list):
                values[f.name] = [value[i] for i in index.tolist()]
        return dataclasses.replace(self, **values)

    def to(self, device: torch.device | str) -> "ExperienceBatch":
        """The same batch with every tensor on `device`."""
        values = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **values)


def concat_batches(batches: Sequence[ExperienceBatch], pad_token_id: int) -> ExperienceBatch:
    """Stack batches row-wise, re-padding prompts on the left and responses on the right.

    An optional field must be set in all batches or in none (mixing would lose data silently).
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    prompt_width = max(b.prompt_ids.shape[1] for b in batches)
    response_width = max(b.response_ids.shape[1] for b in batches)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ExperienceBatch):
        parts = [getattr(b, f.name) for b in batches]
        present = [p is not None for p in parts]
        if any(present) and not all(present):
            raise ValueError(f"field {f.name!r} is set in some batches and not in others")
        if not all(present):
            values[f.name] = None
        elif isinstance(parts[0], list):
            values[f.name] = [item for part in parts for item in part]
        elif parts[0].dim() == 1:
            values[f.name] = torch.cat(parts)
        else:
            left = f.name.startswith("prompt_")
            width = prompt_width if left else response_width
            fill = pad_token_id if f.name.endswith("_ids") else 0
            values[f.name] = torch.cat([_pad_to(p, width, fill, left) for p in parts])
    return ExperienceBatch(**values)


def _pad_to(tensor: torch.Tensor, width: int, fill: int | float, left: bool) -> torch.Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    pad = torch.full((tensor.shape[0], missing), fill, dtype=tensor.dtype)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)
