"""Decode attention as a Triton split-KV kernel: one query token per sequence over its slot's cache.

Why our own: cuDNN's SDPA runs the decode step's attention (one query row per head, a few hundred
cached positions, an additive mask) at about 40% of the memory bandwidth (docs/benchmarks.md), and
FlexAttention compiled with dynamic shapes was 27x slower still; flashinfer's decode kernels are not
on our GPU machine (its 62 MB wheel and its dependencies, the CUTLASS DSL among them, exceed what a
device call carries). The kernel is flash-decoding:

    grid (sequence b, K/V head g, split s)   each program reads K/V positions
                                             [s * split, min((s + 1) * split, position_b + 1)) of
                                             its slot once, block by block, for the H / KVH query
                                             heads that share head g (a tl.dot over the group's
                                             rows, padded to 16), keeping a running max and sum
                                             (online softmax)
    combine (b, g)                           the splits' partial outputs, weighted by their sums

With one split per sequence (`KernelConfig.split == 0`) each program writes its output directly and
no combine runs. The kernel reads each sequence's cache only up to its own position (no mask tensor,
no padding up to the longest sequence): a split past the position costs one program that reads
nothing, so the engine can size the grid by the cache's whole length and capture one CUDA graph
per batch size. Positions past a sequence's own are never read, so the cache there may hold anything.

A sliding window (a query at position p sees p - window < j <= p) is a bound on the positions read,
not a mask over the whole cache: each program starts its block loop at the block holding the
window's first position, max(0, p - window + 1), masks the positions before it within that block,
and reads nothing earlier (a split wholly before the window reads nothing, like one past p).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton: `available()` says so
    triton = None

MIN_ROWS = 16  # tl.dot's smallest dimension: a group's query heads are padded to it


class KernelConfig(NamedTuple):
    """How the work is cut: cache positions per program (`split`; 0: the whole cache, no combine),
    positions per inner step (`block`), and Triton's launch settings."""

    split: int
    block: int
    warps: int
    stages: int


BLOCK_ELEMENTS = 4096  # a block of K (or V) holds this many values: 32 positions at head size 128, 64 at 64


def available() -> bool:
    return triton is not None


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_config(sequences: int, kv_heads: int, length: int, dim: int, device: torch.device) -> KernelConfig:
    """One program per sequence and K/V head when there are at least as many as the GPU has
    multiprocessors (a GRPO batch: 87-97% of the copy bandwidth at Qwen2.5-1.5B's shape, 256 sequences,
    docs/benchmarks.md); fewer sequences split the cache so that every multiprocessor gets work."""
    block = max(MIN_ROWS, BLOCK_ELEMENTS // dim)
    programs, processors = sequences * kv_heads, _processors(device)
    if programs >= processors:
        return KernelConfig(split=0, block=block, warps=2, stages=3)
    splits = min(triton.cdiv(processors, programs), triton.cdiv(length, block))
    return KernelConfig(split=triton.cdiv(triton.cdiv(length, splits), block) * block, block=block, warps=2, stages=3)


if triton is not None:

    @triton.jit
    def _split_kernel(q, k, v, positions, out, acc_out, max_out, sum_out, qk_scale,
                      q_b, q_h, k_b, k_h, k_t, v_b, v_h, v_t, o_b, o_h, split_length, window,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                      DIRECT: tl.constexpr):
        b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = tl.arange(0, ROWS)
        rows_real = rows < GROUP
        heads = g * GROUP + rows
        dims = tl.arange(0, DIM)
        query = tl.load(q + b * q_b + heads[:, None] * q_h + dims[None, :], mask=rows_real[:, None], other=0.0)
        position = tl.load(positions + b)
        end = tl.minimum((s + 1) * split_length, position + 1)
        first = tl.maximum(position + 1 - window, 0)  # the window's first position
        running_max = tl.full([ROWS], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        # From the block holding `first` (no step when the split lies before it or past the position)
        for start in range(tl.maximum(s * split_length, first // BLOCK * BLOCK), end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = (cols >= first) & (cols < end)
            keys = tl.load(k + b * k_b + g * k_h + cols[:, None] * k_t + dims[None, :], mask=valid[:, None], other=0.0)
            values = tl.load(v + b * v_b + g * v_h + cols[:, None] * v_t + dims[None, :], mask=valid[:, None], other=0.0)
            scores = tl.where(valid[None, :], tl.dot(query, tl.trans(keys)) * qk_scale, float("-inf"))  # log2 units
            new_max = tl.maximum(running_max, tl.max(scores, 1))  # finite: every step has a valid position
            weights = tl.exp2(scores - new_max[:, None])
            rescale = tl.exp2(running_max - new_max)  # 0 at the first step
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            running_max = new_max
        if DIRECT:
            tl.store(out + b * o_b + heads[:, None] * o_h + dims[None, :],
                     (acc / running_sum[:, None]).to(out.dtype.element_ty), mask=rows_real[:, None])
        else:
            # partials [b, g, split, row(, dim)]: a split past the position keeps max -inf and sum 0
            at = ((b * tl.num_programs(1) + g) * tl.num_programs(2) + s) * ROWS + rows
            tl.store(max_out + at, running_max)
            tl.store(sum_out + at, running_sum)
            tl.store(acc_out + at[:, None] * DIM + dims[None, :], acc, mask=rows_real[:, None])

    @triton.jit
    def _combine_kernel(acc_in, max_in, sum_in, out, o_b, o_h, splits,
                        SPLITS_BOUND: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr):
        b, g = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, ROWS)
        rows_real = rows < GROUP
        dims = tl.arange(0, DIM)
        first = (b * tl.num_programs(1) + g) * splits * ROWS
        best = tl.full([ROWS], float("-inf"), tl.float32)
        for s in range(SPLITS_BOUND):  # a power of two >= splits, so few variants compile
            real = tl.full([ROWS], s, tl.int32) < splits  # every row of a real split, none past the last
            best = tl.maximum(best, tl.load(max_in + first + s * ROWS + rows, mask=real, other=float("-inf")))
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        for s in range(SPLITS_BOUND):
            real = tl.full([ROWS], s, tl.int32) < splits
            at = first + s * ROWS + rows
            weight = tl.exp2(tl.load(max_in + at, mask=real, other=float("-inf")) - best)  # 0 for an empty split
            total += weight * tl.load(sum_in + at, mask=real, other=0.0)
            acc += weight[:, None] * tl.load(acc_in + at[:, None] * DIM + dims[None, :],
                                             mask=(real & rows_real)[:, None], other=0.0)
        heads = g * GROUP + rows
        tl.store(out + b * o_b + heads[:, None] * o_h + dims[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
                 mask=rows_real[:, None])


def attend_decode_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                         scale: float, config: KernelConfig | None = None, window: int | None = None) -> torch.Tensor:
    """One query per sequence, q [b, H, 1, d], over keys, values [b, KVH, t, d] (a view of the cache)
    at positions [0, positions[b]], with a sliding `window` [max(0, positions[b] - window + 1),
    positions[b]]; [b, H, 1, d] as `decoder.attend_decode` (head h reads K/V head h // (H / KVH)).
    `config` None: `choose_config`'s."""
    batch, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    config = config or choose_config(batch, kv_heads, length, dim, q.device)
    group = heads // kv_heads
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    split_length = config.split or length
    splits = triton.cdiv(length, split_length)
    direct = splits == 1
    out = torch.empty(batch, heads, 1, dim, dtype=q.dtype, device=q.device)
    partials = 0 if direct else batch * kv_heads * splits * rows
    maxima = torch.empty(partials, dtype=torch.float32, device=q.device)  # per split and row
    sums = torch.empty_like(maxima)
    accs = torch.empty(partials, dim, dtype=torch.float32, device=q.device)
    # without a window, one of the cache's length: every sequence's first position is then 0
    _split_kernel[(batch, kv_heads, splits)](
        q, keys, values, positions, out, accs, maxima, sums, scale * math.log2(math.e), q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1), split_length, window or length, GROUP=group, ROWS=rows, DIM=dim,
        BLOCK=config.block, DIRECT=direct, num_warps=config.warps, num_stages=config.stages)
    if not direct:
        _combine_kernel[(batch, kv_heads)](accs, maxima, sums, out, out.stride(0), out.stride(1), splits,
                                           SPLITS_BOUND=triton.next_power_of_2(splits), GROUP=group, ROWS=rows,
                                           DIM=dim)
    return out
