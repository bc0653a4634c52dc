"""Response log-probs of micro-batches through megatron-core's schedules (`get_forward_backward_func`).

The same code serves every layout: with PP = 1 the schedule is a loop over micro-batches; with PP > 1
it is megatron-core's 1F1B pipeline, which passes [s, b, H] activations between stages. A
micro-batch enters as `Packed`, in one of two layouts:
- `pack`: b rows of equal width, each rolled by `model.pack_rows` (pads after each sequence, computed);
- `pack_sequences`: the sequences end to end in one row (b = 1) with their boundaries, so no
  position is a pad (but the few that round the row up to a multiple of 16 on a GPU and of TP); attention stays within
  each sequence (`SDPAttention`), positions restart at 0 per sequence. `packing.token_micro_batches` groups
  rows under a token budget (`policy.micro_batch_tokens`).
The last stage gathers the hidden states that predict the *valid* response tokens only (no output
projection for pads) and computes vocab-parallel log-probs (`logprobs.py`), scattered back to [b, R]
(zero where a response has ended).

- `forward_logprobs`: forward only; results live on the last pipeline stage and are broadcast to
  the other stages, so every rank returns the same [B, R] tensors.
- `forward_backward`: a scalar per micro-batch from `step_fn(logprobs, micro)`, back-propagated.
  The model config sets `calculate_per_token_loss`, so the schedule neither divides the value by
  the number of micro-batches nor by a token count: the caller's value is already normalised by
  the global counts of the update (losses/base.py), and gradients add up across micro-batches.
  With `fill_old_logprobs` (the on-policy shortcut, trainer/loop.py) each micro-batch's own
  log-probs, detached, are its old log-probs, and its entropy is computed as well; both come back
  on every rank as `forward_logprobs` returns them.

All micro-batches of one call must have the same shape under PP > 1 (pipeline p2p buffers are sized
once): `pad_rows` makes the last one full with rows that count nowhere (masks all False), and packed
rows are padded to the call's longest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from aligner_ext.batch import ExperienceBatch, concat_batches
from aligner_ext.generation.base import NOT_RECORDED
from aligner_ext.models.megatron.logprobs import enter_tensor_parallel_region, vocab_parallel_logprobs
from aligner_ext.models.megatron.model import output_weight, pack_rows, stage_forward
from aligner_ext.models.megatron.moe import Routers
from aligner_ext.models.packing import pack_end_to_end, valid_responses


@dataclass
class Packed:
    """One micro-batch in the Megatron layout, on the model's device."""

    ids: torch.Tensor  # [b, S] int64: rolled rows (`pack`) or b = 1 sequences end to end (`pack_sequences`)
    positions: torch.Tensor  # [b, S] int64 position of each token in its own sequence
    response_index: torch.Tensor  # [N] int64 index into the flattened [b * S] hidden states predicting each valid response token
    response_ids: torch.Tensor  # [N] int64 those tokens (row-major over the batch's response_valid)
    batch: ExperienceBatch  # the micro-batch itself (advantages, masks) for the loss
    real: torch.Tensor  # [b, S] bool: the tokens of its sequences (not pads, not filler rows): the routers' statistics
    real_tokens: int  # how many (counted on the host)
    routing: torch.Tensor | None  # [b, S, layers, k] int16 the engine's experts at the real tokens (NOT_RECORDED elsewhere), or None
    boundaries: PackedSeqParams | None = None  # the sequences' cumulative lengths when packed


def pack(micro: ExperienceBatch, pad_token_id: int, device: torch.device, multiple_of: int = 1) -> Packed:
    """`micro` in the rolled-rows layout; the width is padded to a multiple of `multiple_of` (sequence parallel)."""
    input_ids = micro.input_ids
    extra = -input_ids.shape[1] % multiple_of
    if extra:
        input_ids = torch.cat([input_ids, input_ids.new_full((len(micro), extra), pad_token_id)], dim=1)
    ids, positions, columns = pack_rows(micro.prompt_mask, input_ids, pad_token_id)
    width = ids.shape[1]
    index, response_ids = valid_responses(micro, torch.arange(len(micro)) * width + columns[:, 0])
    lengths = (micro.prompt_mask.sum(dim=1) + micro.response_valid.sum(dim=1)) * micro.response_valid.any(dim=1)
    real = torch.arange(width) < lengths[:, None]  # rolled rows: each sequence from column 0
    kept = micro.attention_mask.bool() & micro.response_valid.any(dim=1, keepdim=True)
    return Packed(ids.to(device), positions.to(device), index.to(device), response_ids.to(device), micro.to(device),
                  real.to(device), int(real.sum()), engine_routing(micro, kept, real, device))


def pack_sequences(micro: ExperienceBatch, pad_token_id: int, device: torch.device, multiple_of: int = 1,
                   width: int = 0) -> Packed:
    """`micro`'s sequences end to end in one row (`packing.pack_end_to_end`), padded to a multiple of
    `multiple_of` and to at least `width` (PP's equal shapes), with megatron-core's boundaries."""
    row = pack_end_to_end(micro, pad_token_id, multiple_of, width)
    cu_seqlens = row.cu_seqlens.to(device)
    boundaries = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=row.max_seqlen, max_seqlen_kv=row.max_seqlen)
    # the row's tail, padding it to `width` and to the multiple, is a sequence of its own in cu_seqlens
    real = (torch.arange(row.ids.shape[-1]) < row.cu_seqlens[len(micro)]).view(1, -1) & micro.response_valid.any()
    kept = micro.attention_mask.bool() & micro.response_valid.any()
    return Packed(row.ids.to(device), row.positions.to(device), row.response_index.to(device),
                  row.response_ids.to(device), micro.to(device), real.to(device), int(real.sum()),
                  engine_routing(micro, kept, real, device), boundaries)


def engine_routing(micro: ExperienceBatch, kept: torch.Tensor, real: torch.Tensor, device: torch.device
                   ) -> torch.Tensor | None:
    """The engine's experts of `micro` [b, S, layers, k] int16 on `device` in a layout whose real
    tokens `real` [b, S] are those of `micro` where `kept` [B, P+R], in the same order (row by row,
    prompt then response); NOT_RECORDED elsewhere. None when the batch carries no routing."""
    routing = micro.routing
    if routing is None:
        return None
    placed = torch.full((*real.shape, *routing.shape[2:]), NOT_RECORDED, dtype=routing.dtype)
    placed[real] = routing[kept]
    return placed.to(device)


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
    """Log-probs [b, R] (and entropy) from the last stage's hidden states [s, b, H] (or [s/TP, b, H]
    with SP), computed at the valid response tokens only and zero elsewhere."""
    hidden = enter_tensor_parallel_region(hidden, model.config.sequence_parallel).transpose(0, 1)  # [b, s, H]
    response_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.response_index)
    lp, ent = vocab_parallel_logprobs(response_hidden, output_weight(model), packed.response_ids, vocab_size,
                                      chunk_size, with_entropy, temperature)
    valid = packed.batch.response_valid

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(valid.shape).masked_scatter(valid, values)

    return scatter(lp), scatter(ent) if with_entropy else None


def _run(model, micro_batches: list[Packed], reduce_fn: Callable, forward_only: bool,
         routers: Routers | None = None) -> list:
    """One schedule call; `reduce_fn(packed, hidden)` runs on the last stage per micro-batch.

    `model` is the GPTModel or its DDP wrapper (the schedule needs the wrapper for gradient sync);
    `routers`: a mixture of experts' routers, told each micro-batch's tokens and engine routing
    (moe.py), which give the forward megatron-core's padding mask where its load-balancing loss needs it.
    """
    config = unwrap_model(model).config
    seq = micro_batches[0].ids.shape[1]
    if config.sequence_parallel:
        seq //= config.tensor_model_parallel_size

    def forward_step(data_iterator, stage_model):
        packed = next(data_iterator)
        padding = routers.begin(packed.real, packed.routing, packed.real_tokens) if routers is not None else None
        hidden = stage_forward(unwrap_model(stage_model), packed.ids, packed.positions, packed.boundaries, padding)
        if routers is not None:
            routers.end()

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


def forward_logprobs(model, micro_batches: list[Packed], vocab_size: int, chunk_size: int, temperature: float,
                     routers: Routers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs and entropy [sum of b, R] float32 of every micro-batch, on every rank;
    `routers`: a mixture of experts' (moe.py), compared with or replaying the engine's experts."""

    def reduce_fn(packed: Packed, hidden: torch.Tensor):
        lp, ent = last_stage_logprobs(unwrap_model(model), hidden, packed, vocab_size, chunk_size, True, temperature)
        return torch.stack([lp.float(), ent.float()])

    with torch.no_grad():
        outputs = _run(model, micro_batches, reduce_fn, forward_only=True, routers=routers)
    result = _on_every_stage(outputs, micro_batches)
    return result[0], result[1]


def _on_every_stage(parts: list[torch.Tensor], micro_batches: list[Packed]) -> torch.Tensor:
    """The last stage's [2, b, R] blocks (log-probs, entropy) of the micro-batches, concatenated to
    [2, sum of b, R] and broadcast over PP (the other stages hold none)."""
    rows = sum(len(p.batch) for p in micro_batches)
    width = micro_batches[0].batch.response_valid.shape[1]
    device = micro_batches[0].ids.device
    result = torch.cat(parts, dim=1) if parts else torch.empty(2, rows, width, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(result, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return result


def forward_backward(model, micro_batches: list[Packed], vocab_size: int, chunk_size: int, temperature: float,
                     step_fn: Callable[[torch.Tensor, ExperienceBatch], tuple[torch.Tensor, dict]],
                     fill_old_logprobs: bool = False, routers: Routers | None = None
                     ) -> tuple[list[dict], torch.Tensor | None]:
    """Forward and backward of `step_fn(logprobs [b, R], micro)` -> (scalar, metrics) per micro-batch.

    Returns the metrics dicts (on the last pipeline stage; empty on the others) and, with
    `fill_old_logprobs`, the old log-probs and entropy the micro-batches were given, [2, sum of b, R]
    float32 on every rank (else None). `routers`: a mixture of experts' routers (moe.py).
    """
    filled = []

    def reduce_fn(packed: Packed, hidden: torch.Tensor):
        lp, ent = last_stage_logprobs(unwrap_model(model), hidden, packed, vocab_size, chunk_size, fill_old_logprobs,
                                      temperature)
        micro = packed.batch
        if fill_old_logprobs:
            valid = micro.response_valid
            micro = dataclasses.replace(micro, old_logprobs=lp.detach() * valid, entropy=ent * valid)
            filled.append(torch.stack([micro.old_logprobs.float(), micro.entropy.float()]))
        value, metrics = step_fn(lp, micro)
        return value, torch.ones((), dtype=torch.int, device=value.device), metrics

    outputs = _run(model, micro_batches, reduce_fn, forward_only=False, routers=routers)
    return outputs, _on_every_stage(filled, micro_batches) if fill_old_logprobs else None
