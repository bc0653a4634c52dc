"""The sampler's Gumbel race (sampler.py) as two Triton kernels: the decode step's default draw
(temperature > 0, no top-k or top-p) on a GPU.

Why: compiled by torch.compile, the race and the log-sum-exp of the chosen token's log-prob took
0.39 ms a step at 256 rows x 151,936 entries, 9% of a decode step at the Qwen2.5-1.5B shape, and
their compilation ~3.7 s of the first step (docs/benchmarks.md). Here one pass over the logits does
both:

    race (row b, chunk c)   z = logits / T over RACE_CHUNK entries: their max and sum of exp(z - max),
                            and the race's winner argmax_i (z_i + G_i), G_i from the same
                            counter-based hash as sampler.uniforms (so the same request draws the
                            same token as the torch sampler, up to float rounding in log())
    pick (row b)            the chunks' winners and log-sum-exps combined: token and its log-prob
"""

from __future__ import annotations

import torch

from aligner_ext.generation.sampler import (_GOLDEN, _GOLDEN32, _LOWBIAS1, _LOWBIAS2, _MIX1, _MIX2, RACE_CHUNK)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _shift_right_64(x, shift: tl.constexpr):
        return (x.to(tl.uint64, bitcast=True) >> shift).to(tl.int64, bitcast=True)

    @triton.jit
    def _shift_right_32(x, shift: tl.constexpr):
        return (x.to(tl.uint32, bitcast=True) >> shift).to(tl.int32, bitcast=True)

    @triton.jit
    def _race_kernel(logits, seeds, counters, maxima, sums, winners, scores, temperature, row_stride, width,
                     GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr, GOLDEN32: tl.constexpr,
                     LOWBIAS1: tl.constexpr, LOWBIAS2: tl.constexpr, CHUNK: tl.constexpr):
        b, c = tl.program_id(0), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        valid = cols < width
        z = tl.load(logits + b * row_stride + cols, mask=valid, other=float("-inf")).to(tl.float32) / temperature
        top = tl.max(z, 0)
        total = tl.sum(tl.exp(z - top), 0)
        key = tl.load(seeds + b) * GOLDEN + (tl.load(counters + b) + 1) * MIX2  # sampler.uniforms, per row
        key = (key ^ _shift_right_64(key, 30)) * MIX1
        key = (key ^ _shift_right_64(key, 27)) * MIX2
        key = _shift_right_64(key ^ _shift_right_64(key, 31), 33).to(tl.int32)
        x = key + cols.to(tl.int32) * GOLDEN32  # per entry (32-bit arithmetic wraps)
        x = (x ^ _shift_right_32(x, 16)) * LOWBIAS1
        x = (x ^ _shift_right_32(x, 15)) * LOWBIAS2
        x = x ^ _shift_right_32(x, 16)
        uniform = (_shift_right_32(x, 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        raced = tl.where(valid, z - tl.log(-tl.log(uniform)), float("-inf"))
        best = tl.max(raced, 0)
        at = b * tl.num_programs(1) + c
        tl.store(maxima + at, top)
        tl.store(sums + at, total)
        tl.store(scores + at, best)
        tl.store(winners + at, c * CHUNK + tl.argmax(raced, 0))

    @triton.jit
    def _pick_kernel(logits, maxima, sums, winners, scores, tokens, logprobs, temperature, row_stride, chunks,
                     CHUNKS: tl.constexpr):
        b = tl.program_id(0)
        index = tl.arange(0, CHUNKS)
        real = index < chunks
        at = b * chunks + index
        best = tl.load(scores + at, mask=real, other=float("-inf"))
        token = tl.max(tl.where(index == tl.argmax(best, 0), tl.load(winners + at, mask=real, other=0), 0), 0)
        chunk_max = tl.load(maxima + at, mask=real, other=float("-inf"))
        top = tl.max(chunk_max, 0)
        total = tl.sum(tl.load(sums + at, mask=real, other=0.0) * tl.exp(chunk_max - top), 0)
        chosen = tl.load(logits + b * row_stride + token).to(tl.float32) / temperature
        tl.store(tokens + b, token)
        tl.store(logprobs + b, chosen - top - tl.log(total))


def gumbel_sample(logits: torch.Tensor, temperature: float, seeds: torch.Tensor,
                  counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampler.sample` for temperature > 0 without top-k or top-p: tokens [B] (int64) and their
    log-probs [B] (float32) from `logits` [B, V]."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, width = logits.shape
    chunks = triton.cdiv(width, RACE_CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    sums, scores = torch.empty_like(maxima), torch.empty_like(maxima)
    winners = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _race_kernel[(rows, chunks)](logits, seeds, counters, maxima, sums, winners, scores, temperature,
                                 logits.stride(0), width, GOLDEN=_GOLDEN, MIX1=_MIX1, MIX2=_MIX2, GOLDEN32=_GOLDEN32,
                                 LOWBIAS1=_LOWBIAS1, LOWBIAS2=_LOWBIAS2, CHUNK=RACE_CHUNK)
    _pick_kernel[(rows,)](logits, maxima, sums, winners, scores, tokens, logprobs, temperature, logits.stride(0),
                          chunks, CHUNKS=triton.next_power_of_2(chunks))
    return tokens, logprobs
