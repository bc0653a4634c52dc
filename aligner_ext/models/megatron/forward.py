"""Response log-probs of micro-batches through megatron-core's schedules (`get_forward_backward_func`).

The same code serves every layout: with PP = 1 the schedule is a loop over micro-batches; with PP > 1
it is megatron-core's 1F1B pipeline, which passes [s, b, H] activations between stages. A
micro-batch enters as `Packed` (rows rolled by `model.pack_rows`); the last stage gathers the
hidden states at the response columns and computes vocab-parallel log-probs (`logprobs.py`).

- `forward_logprobs`: forward only; results live on the last pipeline stage and are broadcast to
  the other stages, so every rank returns the same [B, R] tensors.
- `forward_backward`: a scalar per micro-batch from `step_fn(logprobs, micro)`, back-propagated.
  The model config sets `calculate_per_token_loss`, so the schedule neither divides the value by
  the number of micro-batches nor by a token count: the caller's value is already normalised by
  the global counts of the update (losses/base.py), and gradients add up across micro-batches.

All micro-batches of one call must have the same shape (pipeline p2p buffers are sized once);
`pad_rows` makes the last one full with rows that count nowhere (masks all False).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from aligner_ext.batch import ExperienceBatch, concat_batches
from aligner_ext.models.megatron.logprobs import enter_tensor_parallel_region, vocab_parallel_logprobs
from aligner_ext.models.megatron.model import output_weight, pack_rows, stage_forward


@dataclass
class Packed:
    """One micro-batch in the Megatron layout, on the model's device."""

    ids: torch.Tensor  # [b, S] int64, rows rolled so each prompt starts at column 0
    positions: torch.Tensor  # [b, S] int64 column index
    response_columns: torch.Tensor  # [b, R] int64 column whose hidden state predicts response token t
    response_ids: torch.Tensor  # [b, R] int64
    batch: ExperienceBatch  # the micro-batch itself (advantages, masks) for the loss


def pack(micro: ExperienceBatch, pad_token_id: int, device: torch.device, multiple_of: int = 1) -> Packed:
    """`micro` in the Megatron layout; the width is padded to a multiple of `multiple_of` (sequence parallel)."""
    input_ids = micro.input_ids
    extra = -input_ids.shape[1] % multiple_of
    if extra:
        input_ids = torch.cat([input_ids, input_ids.new_full((len(micro), extra), pad_token_id)], dim=1)
    ids, positions, columns = pack_rows(micro.prompt_mask, input_ids, pad_token_id)
    columns = columns[:, : micro.response_ids.shape[1]]
    return Packed(ids.to(device), positions.to(device), columns.to(device), micro.response_ids.to(device),
                  micro.to(device))


def filler_rows(batch: ExperienceBatch, rows: int) -> ExperienceBatch:
    """`rows` copies of the first row of `batch` with all-False masks: they count in no loss or metric."""
    filler = batch.select([0] * rows)
    return dataclasses.replace(filler, response_valid=torch.zeros_like(filler.response_valid),
                               response_mask=torch.zeros_like(filler.response_mask))


def pad_rows(micro: ExperienceBatch, rows: int) -> ExperienceBatch:
    """`micro` grown to `rows` rows with `filler_rows`."""
    missing = rows - len(micro)
    if missing <= 0:
        return micro
    return concat_batches([micro, filler_rows(micro, missing)], pad_token_id=0)


def last_stage_logprobs(model, hidden: torch.Tensor, packed: Packed, vocab_size: int, chunk_size: int,
                        with_entropy: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, R] (and entropy) from the last stage's hidden states [s, b, H] (or [s/TP, b, H] with SP)."""
    hidden = enter_tensor_parallel_region(hidden, model.config.sequence_parallel).transpose(0, 1)  # [b, s, H]
    index = packed.response_columns.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    response_hidden = hidden.gather(1, index)
    return vocab_parallel_logprobs(response_hidden, output_weight(model), packed.response_ids, vocab_size,
                                   chunk_size, with_entropy, temperature)


def _run(model, micro_batches: list[Packed], reduce_fn: Callable, forward_only: bool) -> list:
    """One schedule call; `reduce_fn(packed, hidden)` runs on the last stage per micro-batch.

    `model` is the GPTModel or its DDP wrapper (the schedule needs the wrapper for gradient sync).
    """
    config = unwrap_model(model).config
    seq = micro_batches[0].ids.shape[1]
    if config.sequence_parallel:
        seq //= config.tensor_model_parallel_size

    def forward_step(data_iterator, stage_model):
        packed = next(data_iterator)
        hidden = stage_forward(unwrap_model(stage_model), packed.ids, packed.positions)

        def reduce(output, non_loss_data: bool = False):
            return reduce_fn(packed, output)

        return hidden, reduce

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=micro_batches[0].ids.shape[0],
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def forward_logprobs(model, micro_batches: list[Packed], vocab_size: int, chunk_size: int, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs and entropy [sum of b, R] float32 of every micro-batch, on every rank."""

    def reduce_fn(packed: Packed, hidden: torch.Tensor):
        lp, ent = last_stage_logprobs(unwrap_model(model), hidden, packed, vocab_size, chunk_size, True, temperature)
        return torch.stack([lp.float(), ent.float()])

    with torch.no_grad():
        outputs = _run(model, micro_batches, reduce_fn, forward_only=True)
    rows = sum(p.ids.shape[0] for p in micro_batches)
    width = micro_batches[0].response_ids.shape[1]
    device = micro_batches[0].ids.device
    result = torch.cat(outputs, dim=1) if outputs else torch.empty(2, rows, width, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(result, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return result[0], result[1]


def forward_backward(model, micro_batches: list[Packed], vocab_size: int, chunk_size: int, temperature: float,
                     step_fn: Callable[[torch.Tensor, ExperienceBatch], tuple[torch.Tensor, dict]]) -> list[dict]:
    """Forward and backward of `step_fn(logprobs [b, R], micro)` -> (scalar, metrics) per micro-batch.

    Returns the metrics dicts (on the last pipeline stage; empty on the others).
    """

    def reduce_fn(packed: Packed, hidden: torch.Tensor):
        lp, _ = last_stage_logprobs(unwrap_model(model), hidden, packed, vocab_size, chunk_size, False, temperature)
        value, metrics = step_fn(lp, packed.batch)
        return value, torch.ones((), dtype=torch.int, device=value.device), metrics

    return _run(model, micro_batches, reduce_fn, forward_only=False)
