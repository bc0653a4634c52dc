"""Decode attention as a Triton split-KV kernel: one query token per sequence over its slot's cache.

Why our own: cuDNN's SDPA runs the decode step's attention (one query row per head, a few hundred
cached positions, an additive mask) at about 40% of the memory bandwidth (docs/benchmarks.md), and
FlexAttention compiled with dynamic shapes was 27x slower still; flashinfer's decode kernels are not
on our GPU machine (its 62 MB wheel and its dependencies, the CUTLASS DSL among them, exceed what a
device call carries). The kernel is flash-decoding:

    grid (sequence b, K/V head g, split s)   each program reads K/V positions
                                             [s * SPLIT, min((s + 1) * SPLIT, position_b + 1)) of
                                             its slot once, for the H / KVH query heads that share
                                             head g (a tl.dot over the group's rows, padded to 16),
                                             keeping a running max and sum (online softmax)
    combine (b, g)                           the splits' partial outputs, weighted by their sums

It reads each sequence's cache only up to its own position (no mask tensor, no padding up to the
longest sequence) and spreads a long cache over several programs. Positions past a sequence's own
are never read, so the cache there may hold anything.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton: `available()` says so
    triton = None

SPLIT = 128  # cache positions per program
BLOCK = 64  # positions per inner step
MIN_ROWS = 16  # tl.dot's smallest dimension: a group's query heads are padded to it


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _split_kernel(q, k, v, positions, acc_out, max_out, sum_out, scale,
                      q_b, q_h, k_b, k_h, k_t, v_b, v_h, v_t, splits,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr):
        b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        heads = g * GROUP + tl.arange(0, ROWS)
        rows_real = tl.arange(0, ROWS) < GROUP
        dims = tl.arange(0, DIM)
        query = tl.load(q + b * q_b + heads[:, None] * q_h + dims[None, :], mask=rows_real[:, None], other=0.0)
        position = tl.load(positions + b)
        running_max = tl.full([ROWS], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        for step in range(SPLIT // BLOCK):
            cols = s * SPLIT + step * BLOCK + tl.arange(0, BLOCK)
            valid = cols <= position  # masked loads read nothing: a block past the position costs no bandwidth
            keys = tl.load(k + b * k_b + g * k_h + cols[:, None] * k_t + dims[None, :], mask=valid[:, None], other=0.0)
            scores = tl.where(valid[None, :], tl.dot(query, tl.trans(keys)) * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: keep exp() finite
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(running_max - shift)
            values = tl.load(v + b * v_b + g * v_h + cols[:, None] * v_t + dims[None, :], mask=valid[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            running_max = new_max
        # partials [b, g, split, row(, dim)]: a split past the position keeps max -inf and sum 0
        at = ((b * tl.num_programs(1) + g) * splits + s) * ROWS + tl.arange(0, ROWS)
        tl.store(max_out + at, running_max)
        tl.store(sum_out + at, running_sum)
        tl.store(acc_out + at[:, None] * DIM + dims[None, :], acc)

    @triton.jit
    def _combine_kernel(acc_in, max_in, sum_in, out, o_b, o_h, splits,
                        SPLITS_BOUND: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr):
        b, g = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, ROWS)
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
            weight = tl.exp(tl.load(max_in + at, mask=real, other=float("-inf")) - best)  # 0 for an empty split
            total += weight * tl.load(sum_in + at, mask=real, other=0.0)
            acc += weight[:, None] * tl.load(acc_in + at[:, None] * DIM + dims[None, :], mask=real[:, None], other=0.0)
        heads = g * GROUP + rows
        tl.store(out + b * o_b + heads[:, None] * o_h + dims[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
                 mask=(rows < GROUP)[:, None])


def attend_decode_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One query per sequence, q [b, H, 1, d], over keys, values [b, KVH, t, d] (a view of the cache)
    at positions [0, positions[b]]; [b, H, 1, d] as `decoder.attend_decode` (head h reads K/V head
    h // (H / KVH))."""
    batch, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    splits = triton.cdiv(length, SPLIT)
    maxima = torch.empty(batch * kv_heads * splits * rows, dtype=torch.float32, device=q.device)  # per split and row
    sums = torch.empty_like(maxima)
    accs = torch.empty(maxima.numel(), dim, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, 1, dim, dtype=q.dtype, device=q.device)
    _split_kernel[(batch, kv_heads, splits)](
        q, keys, values, positions, accs, maxima, sums, scale, q.stride(0), q.stride(1), keys.stride(0),
        keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2), splits,
        GROUP=group, ROWS=rows, DIM=dim, SPLIT=SPLIT, BLOCK=BLOCK)
    _combine_kernel[(batch, kv_heads)](accs, maxima, sums, out, out.stride(0), out.stride(1), splits,
                                       SPLITS_BOUND=triton.next_power_of_2(splits), GROUP=group, ROWS=rows, DIM=dim)
    return out
