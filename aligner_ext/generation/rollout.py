"""The rollout engine: continuous batching over a preallocated KV cache, on the policy's own weights.

`generate` serves one call at a time, as the loop asks:
  1. allocate a `SlotKVCache` for the call (slots = min(max_batch_size, requests, what fits in
     `kv_cache_memory_share` of free GPU memory), length = longest prompt + max_new_tokens, rounded up
     on a GPU to a multiple of 16 so that prompts of another width compile nothing (aligner_ext/widths.py)); with
     `prefix_cache` it is kept after the call (`KeptCache`) until the next call ends, the weights
     change, or `release_memory` (which the loop calls before the policy trains, so training never
     shares memory with it);
  2. admit waiting requests, in order, into free slots (lowest first) and prefill them together;
     requests with the same prompt ids in one admission are prefilled once and the KV rows copied
     (`share_prompt_prefill`: a GRPO group's n samples, MTPO's H continuations); a prompt that
     extends a sequence of the kept cache by whole blocks of PREFIX_BLOCK tokens gets that prefix's
     K/V copied and prefills only the rest (MTPO's round 2 continues round 1's answers);
  3. decode one token for slots [0, highest busy slot]: the step (decoder, sampler, advancing each
     slot's token, position and sampling counter) runs on the device from device-resident state;
     on a GPU it is replayed from a CUDA graph captured per (rows, attended length) bucket (per rows
     alone with the Triton attention, which reads each sequence to its own position), and
     the host launches the next step before reading this one's tokens (one step of look-ahead),
     so the GPU never waits for the host's bookkeeping;
  4. the host reads the sampled tokens, checks finishes for all slots at once (numpy), and frees
     the slot of a finished sequence; the next waiting request takes it at the next admission. A
     step launched before the host saw a sequence finish computes one token for it that is dropped.
Steps 2-4 live in batching.py (`SlotBatcher`), which the call (`_Call`) shares with turn sessions.

Turn sessions (`open_session`, turns.py) serve multi-turn episodes with the same machinery over one
cache of fixed length: a turn of an episode continues in the slot its earlier turns left pinned (the
slot holds the trajectory's K/V, so a turn prefills only its new tokens), turns of many episodes
decode together, each turn's tokens are those of a `generate` call on its whole ids, and under memory
pressure the least recently used idle episode's slot is evicted and its next turn recomputed.

Sampling (sampler.py; on a GPU the default draw by the Triton race of sample_kernel.py) draws each
request from its own stream, seeded by (call seed, request index),
so its tokens do not depend on which requests share its batch, on the slot count or on the
prefill sharing. Finishing: EOS (unless `ignore_eos`), a stop token id or stop string ("stop"), or
`max_new_tokens` ("length"); EOS and stops are kept, as in the HF engine (hf.py), whose semantics
this engine follows token for token (tests/unit/generation/test_rollout_engine.py).

A mixture of experts asked with `return_routing` (the trainer reads it, models/moe.py) records the experts
each token took in every layer (`decoder.RoutingRecord`, beside the KV cache): the prefill writes its
tokens', each decode step its own inside the step (so inside the CUDA graph); a shared prompt's or kept
prefix's rows are copied with their K/V (a kept cache that recorded none is not reused by a call that
records); a finished request's rows are copied out on the device before its slot is taken again, and
come back as `GenerationOutput.routing`.

Under expert parallelism (a mixture of experts on the Megatron backend at
policy.expert_model_parallel_size > 1: the decoder's `exchange`, decoder.py's `ExpertExchange`) each
rank of an expert-parallel group decodes its own requests, but every MoE layer trades tokens with
the group's other ranks, so they run in lockstep. Per call the ranks agree on the cache length (the
longest any rank needs) and the slot count (for the most requests any rank has, as many as fit on
every rank), and check that they sample alike; per loop turn one agreement (a gloo all-reduce of
three host integers, outside the captured step) says whether any rank prefills, and the decode
step's rows and attended length, the most any rank needs. A rank with nothing to prefill then joins
with an idle pass (its experts compute the others' tokens), a rank with no busy slot decodes its
idle ones, and a call without requests of its own runs until its group is done; a prefill pads its
tokens to the group's most inside the decoder. So every rank's decode step has the same shape and
graph context at every turn, and the CUDA graphs (which hold the exchange's NCCL collectives) are
warmed up, which runs the step's collectives once more, on every rank of the group at the same turn.

Runs every family aligner_ext/architecture.py describes (decoder.py: sliding windows, per-layer
RoPE tables, the families' norms; mixtures of experts, on the Megatron backend under expert
parallelism too) in the policy's dtype: bf16 on a GPU, float32 on the CPU (no CUDA graphs or compilation there). A slot holds one sequence for its life (no paged blocks): a prompt
that extends a kept sequence copies its K/V rather than sharing them; a windowed layer's cache keeps
every position too (only the window is read).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import islice

import numpy as np
import torch

from aligner_ext.generation import sample_kernel
from aligner_ext.generation.base import ENGINES, GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.batching import SlotBatcher, routing_on_host, weights_fingerprint
from aligner_ext.generation.decoder import HFDecoder, SlotKVCache
from aligner_ext.generation.hf import check_request, eos_ids_of
from aligner_ext.generation.sampler import request_seed, sample
from aligner_ext.generation.settings import RolloutEngineConfig
from aligner_ext.generation.stopping import StopStringMatcher
from aligner_ext.generation.turns import TurnSession
from aligner_ext.widths import padded_width

PREFIX_BLOCK = 16  # kept sequences are matched by whole blocks of this many tokens


def block_hashes(tokens: list[int]):
    """(end, hash) for each whole block of PREFIX_BLOCK tokens of `tokens`: the hash chains the
    blocks before it, so equal hashes mean equal prefixes (up to a collision, checked on use)."""
    key = 0
    for end in range(PREFIX_BLOCK, len(tokens) + 1, PREFIX_BLOCK):
        key = hash((key, tuple(tokens[end - PREFIX_BLOCK : end])))
        yield end, key


class KeptCache:
    """A finished call's KV cache, kept for the next call (`prefix_cache`): per slot, the tokens whose
    K/V it holds (the prompt and every generated token but the last, which was never fed back), and
    their prefixes of whole blocks, so a later prompt that extends one prefills only its new tokens."""

    def __init__(self, cache: SlotKVCache, sequences: dict[int, list[int]], weights: tuple):
        self.cache, self.sequences, self.weights = cache, sequences, weights
        self.blocks: dict[int, tuple[int, int]] = {}  # chain hash -> (slot, prefix length)
        for slot, tokens in sequences.items():
            for end, key in block_hashes(tokens):
                self.blocks.setdefault(key, (slot, end))

    def longest_prefix(self, prompt: list[int]) -> tuple[int, int]:
        """(slot, length) of the longest kept prefix of `prompt` in whole blocks that leaves at least
        its last token to prefill (its logits start the sampling); (-1, 0) when none."""
        found = (-1, 0)
        for _, key in block_hashes(prompt[:-1]):
            hit = self.blocks.get(key)
            if hit is None:
                break
            found = hit
        slot, length = found
        if length and self.sequences[slot][:length] != prompt[:length]:  # a hash collision
            return -1, 0
        return found


@ENGINES.register("rollout")
class RolloutEngine(GenerationEngine):
    """Continuous-batching generation over the policy's own weights (module docstring)."""

    reports_finished = True

    def __init__(self, model, tokenizer, cfg: RolloutEngineConfig):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.last_call: dict = {}  # what the latest call did (decode steps, graphs captured, their time)
        self.kept: KeptCache | None = None  # the latest call's KV cache (prefix_cache)
        self.update_weights(model)

    def update_weights(self, policy_model) -> None:
        """Run the policy's parameters themselves (nothing is copied): an HF model's, or those of a
        model that provides `rollout_decoder(compile, fuse_projections, attention)` (the Megatron
        backend's `MegatronGenerationModel`)."""
        self.kept = None
        self.model = policy_model
        self.on_gpu = next(policy_model.parameters()).device.type == "cuda"
        compile = self.on_gpu and self.cfg.compile
        if getattr(self, "decoder", None) is None or self.decoder.model is not policy_model:
            # A backend's model may bring its own decoder (the Megatron backend's shards); else an HF model's.
            make_decoder = getattr(policy_model, "rollout_decoder", None) or partial(HFDecoder, policy_model)
            self.decoder = make_decoder(compile=compile, fuse_projections=self.cfg.fuse_projections,
                                        attention=self.cfg.attention)
            self.warmed_steps: set = set()  # decode-step shapes run before (`_DecodeGraphs`)
            # Fully dynamic: with a static 152k vocabulary Inductor folds the sampler's hash constants
            # into an int32 literal that overflows (torch 2.11, Triton 3.6).
            self.sample = torch.compile(sample, dynamic=True) if compile else sample
            if compile and sample_kernel.available():
                self.sample = partial(_draw, self.sample)
        self.eos_ids = eos_ids_of(self.tokenizer, policy_model)

    def release_memory(self) -> None:
        """Drop the kept KV cache before the policy trains (each call's own cache is freed when it returns)."""
        self.kept = None

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 should_stop: Callable[[], bool] | None = None, caps: list[int] | None = None,
                 on_finished: Callable[[int], None] | None = None) -> list[GenerationOutput]:
        """Continue every prompt once; a `should_stop` that turns true (a server's client left, enough groups
        finished) ends the call between decode steps, its slots freed and outputs cut where they are. `caps`:
        per prompt, the most tokens it may add, each at most `params.max_new_tokens` (resumed responses);
        `on_finished(i)` is called once prompt i's output is whole, between decode steps."""
        check_request(prompts, params)
        if caps is not None and (len(caps) != len(prompts)
                                 or not all(0 < cap <= params.max_new_tokens for cap in caps)):
            raise ValueError(f"caps: one per prompt, each in [1, max_new_tokens={params.max_new_tokens}]")
        if not prompts and self.decoder.exchange is None:  # under expert parallelism it joins its group's call
            return []
        call_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        matcher = StopStringMatcher(params.stop, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        self.decoder.refresh()
        weights = weights_fingerprint(self.model)
        kept, self.kept = self.kept, None
        if kept is not None and kept.weights != weights:
            kept = None  # the weights changed since it was computed
        record_routing = params.return_routing and self.decoder.records_routing
        if kept is not None and record_routing and kept.cache.routing is None:
            kept = None  # its prefixes' experts were not recorded
        with torch.inference_mode():
            call = _Call(self, prompts, params, call_seed, matcher, kept, weights, record_routing, caps, on_finished)
            return call.run(should_stop)

    def open_session(self, params: SamplingParams, max_length: int, max_episodes: int) -> TurnSession:
        """Turns of multi-turn episodes on kept KV cache slots (turns.py)."""
        return TurnSession(self, params, max_length, max_episodes)

    def slot_count(self, requests: int, length: int, record_routing: bool = False) -> int:
        """How many sequences a call's cache holds (with the experts' record when it records routing);
        under expert parallelism the same on every rank of the group (module docstring), 0 when no
        rank has a request."""
        fits = self.cfg.max_batch_size
        if self.decoder.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.decoder.device)
            per_slot_token = self.decoder.cache_bytes_per_slot_token(record_routing)
            fits = int(free * self.cfg.kv_cache_memory_share) // (per_slot_token * length)
            if fits < 1:
                raise RuntimeError(f"no KV-cache slot of {length} tokens fits in {self.cfg.kv_cache_memory_share:.0%} "
                                   f"of the {free / 2**30:.1f} GiB free; raise generator.rollout.kv_cache_memory_share "
                                   "or shorten prompts / max_new_tokens")
        if self.decoder.exchange is not None:
            requests, fewest = self.decoder.exchange.agree([requests, -fits])
            fits = -fewest
        return min(self.cfg.max_batch_size, requests, fits)

    def group_length(self, length: int, params: SamplingParams, record_routing: bool) -> int:
        """Under expert parallelism, the cache length of a call: the longest any rank of the group
        needs; first checking that the ranks sample alike, since the decode step's graphs are warmed
        and captured per sampling setting (module docstring)."""
        setting = hash((params.temperature, params.top_p, params.top_k, record_routing)) % 2**62
        longest, most, fewest = self.decoder.exchange.agree([length, setting, -setting])
        if most != -fewest:
            raise ValueError("under expert parallelism the ranks of a group decode with the same temperature, "
                             "top_p, top_k and return_routing")
        return longest


def _draw(compiled_sample, logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seeds: torch.Tensor,
          counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A compiled engine's sampler: the Triton race (sample_kernel.py) for the default draw
    (temperature > 0, no top-k or top-p), the compiled torch sampler for the others."""
    if temperature > 0 and top_p >= 1.0 and not 0 < top_k < logits.shape[-1]:
        return sample_kernel.gumbel_sample(logits, temperature, seeds, counters)
    return compiled_sample(logits, temperature, top_p, top_k, seeds, counters)



class _Call(SlotBatcher):
    """One `generate` call: its requests (their indices in `prompts`), the kept cache it starts from, the
    order requests wait in and the slots free for them."""

    def __init__(self, engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, call_seed: int,
                 matcher: StopStringMatcher, kept: KeptCache | None, weights: tuple, record_routing: bool = False,
                 caps: list[int] | None = None, on_finished: Callable[[int], None] | None = None):
        self.prompts = [list(prompt) for prompt in prompts]
        self.weights = weights
        # Per request: the kept slot and prefix length it starts from; the kept cache is released
        # before this call allocates its own when no prompt extends a kept sequence.
        self.prefixes = [kept.longest_prefix(prompt) if kept else (-1, 0) for prompt in self.prompts]
        self.kept = kept if any(length for _, length in self.prefixes) else None
        self.seeds = [request_seed(call_seed, index) for index in range(len(prompts))]
        count = len(prompts)
        self.max_new_tokens = list(caps) if caps is not None else [params.max_new_tokens] * count
        self.on_finished = on_finished
        # on a GPU a multiple of 16, so that a new prompt width compiles no decode-attention kernel (aligner_ext/widths.py)
        # and warms no new decode-step shape (positions past a sequence's own are never read)
        length = padded_width(max(map(len, self.prompts), default=0) + params.max_new_tokens, engine.decoder.device)
        if engine.decoder.exchange is not None:
            length = engine.group_length(length, params, record_routing)
        slot_total = engine.slot_count(count, length, record_routing)
        super().__init__(engine, params, matcher, slot_total, length, params.max_new_tokens, record_routing)
        self.outputs: list[GenerationOutput | None] = [None] * count
        self.free = list(range(self.slot_total))
        self.waiting = deque(range(count))
        # Per request, with record_routing: the experts of the tokens it fed through the model, copied on
        # the device out of its slot's record when it finishes (before another request takes the slot).
        self.routing: list[torch.Tensor | None] = [None] * count

    def run(self, should_stop: Callable[[], bool] | None = None) -> list[GenerationOutput]:
        if not self.slot_total:  # under expert parallelism: no rank of the group has a request
            return []
        exchange = self.decoder.exchange
        self._allocate()
        stopped = False
        while True:
            if not stopped and should_stop is not None and should_stop():
                stopped = True  # steps still in flight are dropped: nobody reads this call's outputs
                self._cut_unfinished()
                if exchange is None:
                    break
                self.waiting.clear()  # under expert parallelism it keeps joining its group, with no work
                self.occupant[:] = -1
                self.in_flight.clear()
            admitting = bool(self.waiting and self.free)
            if exchange is not None:  # lockstep (module docstring): whether any rank prefills, the step's shape
                prefilling, rows, last = exchange.agree([int(admitting), *self._ahead()])
                if not (prefilling or rows):
                    break
            elif not (self.waiting or (self.occupant >= 0).any()):
                break
            if admitting:
                admitted = []
                while self.waiting and self.free:
                    admitted.append((self.waiting.popleft(), heapq.heappop(self.free)))
                self._admit(admitted)
            elif exchange is not None and prefilling:
                self.decoder.idle_prefill()
            busy = (self.occupant >= 0).any()
            if exchange is None:  # the step's shape from the slots now busy
                rows, last = self._busy_shape()
            if rows:
                self._decode(rows, last, read=busy)
            self._read_launched()
        if self.on_gpu:  # this call's stream only: training may queue on another (experience/ahead.py)
            torch.cuda.current_stream(self.decoder.device).synchronize()
        graphs = self.graphs
        self.engine.last_call = {"decode_steps": self.steps, "slots": self.slot_total,
                                 "graphs_captured": len(graphs.graphs) if graphs else 0,
                                 "graph_capture_s": graphs.capture_s if graphs else 0.0,
                                 "prefilled_tokens": self.prefilled_tokens, "prefix_reused_tokens": self.reused_tokens}
        self.kept = None
        if self.engine.cfg.prefix_cache and not stopped:
            self.engine.kept = KeptCache(self.slots.cache, {
                slot: self.prompts[index] + self.tokens[slot, : self.generated[slot] - 1].tolist()
                for slot, index in enumerate(self.holder) if index >= 0}, self.weights)
        if self.record_routing and not stopped:
            for output, routing in zip(self.outputs, routing_on_host(self.routing)):
                output.routing = routing
        never_admitted = GenerationOutput(token_ids=[], finish_reason="length",
                                          logprobs=[] if self.params.return_logprobs else None)
        return [output or never_admitted for output in self.outputs]

    def _cut_unfinished(self) -> None:
        """A stopped call's outputs: each request in a slot ends where it is ("length")."""
        for slot in np.flatnonzero(self.occupant >= 0):
            self.outputs[self.occupant[slot]] = self._output(slot, "length")

    def _ahead(self) -> tuple[int, int]:
        """What this loop turn's decode step needs, before its admission: the rows (slots [0, highest
        busy slot], counting the lowest free ones the admission takes) and the highest position it
        feeds (an admitted prompt's is its length)."""
        rows, last = self._busy_shape()
        admitted = min(len(self.waiting), len(self.free))
        if admitted:
            rows = max(rows, max(heapq.nsmallest(admitted, self.free)) + 1)
            last = max(last, max(len(self.prompts[index]) for index in islice(self.waiting, admitted)))
        return rows, last

    def _prefix_starts(self, runs: list[tuple[int, int]]) -> list[int]:
        """A prompt that extends a kept sequence gets its prefix's K/V copied from the kept cache."""
        starts = [self.prefixes[index][1] for index, _ in runs]
        reused = [(self.prefixes[index][0], slot) for (index, slot), start in zip(runs, starts) if start]
        if reused:
            self.slots.cache.copy_from(self.kept.cache, *map(list, zip(*reused)), max(starts))
        return starts

    def _finish(self, index: int, slot: int, finish_reason: str) -> None:
        if self.record_routing:
            self.routing[index] = self._routing_of(slot, len(self.prompts[index]) + int(self.generated[slot]) - 1)
        self.outputs[index] = self._output(slot, finish_reason)
        heapq.heappush(self.free, slot)
        if self.on_finished is not None:
            self.on_finished(index)
