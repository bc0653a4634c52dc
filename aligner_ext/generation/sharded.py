"""Generation split across the processes of a torchrun run: each rank samples a share of every call.

Either every rank holds a whole model the engine samples from (the policy's HF module, or the
Megatron backend's HF copy refitted after each update), so any rank can serve any request; or the
engine decodes on the Megatron backend's tensor-parallel shards, where the TP ranks of one DP rank
decode the same requests together, so the split runs over the data-parallel group (the engine's
model names it: `split_group`) and W, r below are that group's size and rank.
`RankSplitEngine` wraps the configured engine: for each `generate` call, rank r of W continues its
contiguous share of the prompts (`distributed.share`: the first `len % W` ranks take one more),
then the outputs are all-gathered (`distributed.map_split`), so every rank returns the same full
list in request order and the rest of the loop stays replicated. Training rollouts, MTPO's two
rounds and the greedy held-out evaluation all call the engine, so all of them are split. Each rank
generates 1/W of a call's requests, plus one all-gather of token ids and log-probs; what that saves
depends on whether generation time grows with the rows (on a CPU; not in the HF engine's token loop
on a GPU at small sizes: docs/megatron.md measures both).

Sampling randomness: rank r draws its share from its own stream, seeded `seed * W + r` where
`seed` is the call's `SamplingParams.seed` (the experience makers derive it from the trainer seed
and the step, and MTPO also from the round). The map (seed, r) -> seed * W + r is one-to-one, so no
two (call, rank) pairs share a stream, and with W = 1 it is the unsplit engine's seed. A call
without a seed takes one number from the global torch RNG as its `seed` (every rank draws one, so
the ranks' RNGs advance alike; checkpoints restore it, trainer/checkpoint.py). Either way a resumed
run samples the same responses, provided it runs with the same number of processes: the shares and
seeds depend on W. Greedy calls (temperature 0) draw nothing and keep their seed. Splitting changes
which stream samples a request, so a run of W processes samples different (equally distributed)
responses than a run of one; a run of one never builds this wrapper (`split_across_ranks`) and is
unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from aligner_ext import distributed
from aligner_ext.generation.base import EngineWrapper, GenerationEngine, GenerationOutput, SamplingParams


class RankSplitEngine(EngineWrapper):
    """`inner` on this rank's share of each call's prompts; every rank returns all outputs, in order.

    A collective: every rank must call `generate` with the same number of prompts and the same params.
    With `group` (an engine on tensor-parallel shards: the data-parallel group), shares and seeds go
    by the rank within it, so the ranks that hold one model's shards get the same share and seed and
    decode it together.
    """

    def __init__(self, inner: GenerationEngine, group=None):
        super().__init__(inner)
        self.group = group

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        world, rank_index = dist.get_world_size(self.group), dist.get_rank(self.group)
        share_params = replace(params, seed=rank_seed(params, rank_index, world))
        return distributed.map_split(lambda share: self.inner.generate(share, share_params), prompts, self.group)



def rank_seed(params: SamplingParams, rank_index: int, world: int) -> int | None:
    """The seed of rank `rank_index`'s share of a call: `seed * world + rank_index` (module docstring)."""
    if params.temperature == 0:
        return params.seed
    seed = params.seed if params.seed is not None else int(torch.randint(2**31, ()))
    return seed * world + rank_index


def split_across_ranks(engine: GenerationEngine, enabled: bool, group=None) -> GenerationEngine:
    """`engine` wrapped in a RankSplitEngine over `group` (default: every rank) if `enabled` and the
    group has several ranks."""
    if enabled and dist.is_initialized() and dist.get_world_size(group) > 1:
        return RankSplitEngine(engine, group)
    return engine
