"""Token sampling with one random stream per request, so a request's tokens do not depend on which
other requests share its batch (continuous batching changes that from step to step).

A draw is the Gumbel-max race, an exact sample of the filtered distribution:

    log p = filter(log_softmax(z / T))         top-k, then top-p (`hf.filtered_log_probs`), renormalised
    x     = argmax_i (log p_i + G_i),  G_i = -log(-log u_i)

(without top-k / top-p, log p_i = z_i / T - logsumexp(z / T), and the race runs on z / T: the
constant does not move the argmax). u_i in (0, 1) comes from a counter-based hash, so no generator
state is kept: a 64-bit key per row from (request seed, token index) (SplitMix64's finaliser on
int64), then a 32-bit hash of (key, i) per vocabulary entry (int32 arithmetic: the per-entry work
must be cheap at a 152k vocabulary). The race's argmax runs in two stages, over chunks of
RACE_CHUNK entries and then over the chunks' winners, so that a compiled kernel works on
B x V / RACE_CHUNK rows in parallel instead of B rows of the whole vocabulary. Unlike
inverse-CDF sampling it needs no cumulative sum over the vocabulary.

Temperature 0 is greedy (argmax). The log-prob returned is that of the chosen token under the
distribution it was drawn from (after temperature, top-k and top-p); greedy reports the
temperature-1 log-softmax, as the HF engine does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aligner_ext.generation.hf import filtered_log_probs

RACE_CHUNK = 2048  # vocabulary entries per row of the race's first stage


def _signed(value: int, bits: int = 64) -> int:
    """A `bits`-bit pattern as the signed integer of that width that holds it."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _shift_right(x: torch.Tensor, shift: int, bits: int = 64) -> torch.Tensor:
    """Logical right shift of signed `bits`-bit values (torch's `>>` is arithmetic)."""
    return (x >> shift) & ((1 << (bits - shift)) - 1)


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # SplitMix64
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_GOLDEN32 = _signed(0x9E3779B9, 32)  # lowbias32
_LOWBIAS1 = _signed(0x7FEB352D, 32)
_LOWBIAS2 = _signed(0x846CA68B, 32)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float32 in (0, 1): entry (b, i) depends on (seeds[b], counters[b], i) only (int64
    `seeds`, `counters` [B]); 23 random bits, centred in their interval so that neither 0 nor 1 occurs
    (float32 holds 1 - 2**-24 exactly, not 1 - 2**-25)."""
    key = seeds * _GOLDEN + (counters + 1) * _MIX2  # per row: SplitMix64's finaliser
    key = (key ^ _shift_right(key, 30)) * _MIX1
    key = (key ^ _shift_right(key, 27)) * _MIX2
    key = _shift_right(key ^ _shift_right(key, 31), 33).to(torch.int32)
    x = key[:, None] + torch.arange(width, dtype=torch.int32, device=seeds.device) * _GOLDEN32
    x = (x ^ _shift_right(x, 16, 32)) * _LOWBIAS1  # per entry: a 32-bit finaliser (lowbias32)
    x = (x ^ _shift_right(x, 15, 32)) * _LOWBIAS2
    x = x ^ _shift_right(x, 16, 32)
    return (_shift_right(x, 9, 32).float() + 0.5) * 2.0**-23


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """argmax_i (scores_i + G_i) per row of `scores` [B, V], G_i standard Gumbel noise from
    `uniforms`, in two stages (module docstring)."""
    rows, width = scores.shape
    chunk = min(width, RACE_CHUNK)
    chunks = -(-width // chunk)
    noise = -torch.log(-torch.log(uniforms(seeds, counters, chunks * chunk)))
    raced = F.pad(scores, (0, chunks * chunk - width), value=float("-inf")) + noise
    best, where = raced.view(rows, chunks, chunk).max(dim=-1)
    winner = best.argmax(dim=-1, keepdim=True)
    return (winner * chunk + where.gather(-1, winner)).squeeze(-1)


def request_seed(call_seed: int, index: int) -> int:
    """The stream of request `index` of a call seeded `call_seed` (distinct for distinct pairs)."""
    return _signed(call_seed * 0x100000001B3 + index)


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seeds: torch.Tensor,
           counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and their log-probs [B] from `logits` [B, V], read in float32 (compiled, the upcast
    fuses into the kernels that read them); `seeds`, `counters` [B] int64."""
    logits = logits.float()
    if temperature == 0:
        token_ids = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        return token_ids, log_probs.gather(-1, token_ids[:, None]).squeeze(-1)
    if 0 < top_k < logits.shape[-1] or top_p < 1.0:
        log_probs = filtered_log_probs(logits, temperature, top_k, top_p)
        token_ids = gumbel_argmax(log_probs, seeds, counters)
        return token_ids, log_probs.gather(-1, token_ids[:, None]).squeeze(-1)
    scaled = logits / temperature
    token_ids = gumbel_argmax(scaled, seeds, counters)
    chosen = scaled.gather(-1, token_ids[:, None]).squeeze(-1)
    return token_ids, chosen - torch.logsumexp(scaled, dim=-1)
