"""Token sampling with one random stream per request, so a request's tokens do not depend on which
other requests share its batch (continuous batching changes that from step to step).

A draw is the Gumbel-max race, an exact sample of the filtered distribution:

    log p = filter(log_softmax(z / T))         top-k, then top-p (`hf.filtered_log_probs`), renormalised
    x     = argmax_i (log p_i + G_i),  G_i = -log(-log u_i)

where u_i in (0, 1) comes from (request seed, token index t, vocabulary entry i) through a
counter-based hash (SplitMix64's finaliser on int64 tensors), so it needs no generator state.
Unlike inverse-CDF sampling it needs no cumulative sum over the vocabulary: under torch.compile
the noise, the sum and the argmax fuse into one pass over the logits.

Temperature 0 is greedy (argmax). The log-prob returned is that of the chosen token under the
distribution it was drawn from (after temperature, top-k and top-p); greedy reports the
temperature-1 log-softmax, as the HF engine does.
"""

from __future__ import annotations

import torch

from aligner_ext.generation.hf import filtered_log_probs

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float32 in (0, 1) from int64 `seeds` and `counters` [B]: entry (b, i) hashes
    (seeds[b], counters[b] * width + i) with wrapping int64 arithmetic; 24 random bits, centred
    in their interval so that neither 0 nor 1 occurs."""
    index = counters[:, None] * width + torch.arange(width, device=seeds.device)
    x = seeds[:, None] * _GOLDEN + (index + 1) * _MIX2
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).float() + 0.5) * 2.0**-24


def request_seed(call_seed: int, index: int) -> int:
    """The stream of request `index` of a call seeded `call_seed` (distinct for distinct pairs)."""
    return _signed(call_seed * 0x100000001B3 + index)


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seeds: torch.Tensor,
           counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and their log-probs [B] from float32 `logits` [B, V]; `seeds`, `counters` [B] int64."""
    if temperature == 0:
        token_ids = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        return token_ids, log_probs.gather(-1, token_ids[:, None]).squeeze(-1)
    log_probs = filtered_log_probs(logits, temperature, top_k, top_p)
    gumbel = -torch.log(-torch.log(uniforms(seeds, counters, logits.shape[-1])))
    token_ids = (log_probs + gumbel).argmax(dim=-1)
    return token_ids, log_probs.gather(-1, token_ids[:, None]).squeeze(-1)
