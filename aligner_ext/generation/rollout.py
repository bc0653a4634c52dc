"""The rollout engine: continuous batching over a preallocated KV cache, on the policy's own weights.

`generate` serves one call at a time, as the loop asks:
  1. allocate a `SlotKVCache` for the call (slots = min(max_batch_size, requests, what fits in
     `kv_cache_memory_share` of free GPU memory), length = longest prompt + max_new_tokens); with
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
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import islice

import numpy as np
import torch

from aligner_ext.generation import sample_kernel
from aligner_ext.generation.base import ENGINES, NOT_RECORDED, GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.decoder import HFDecoder, SlotKVCache
from aligner_ext.generation.hf import check_request, eos_ids_of
from aligner_ext.generation.sampler import request_seed, sample
from aligner_ext.generation.settings import RolloutEngineConfig
from aligner_ext.generation.stopping import StopStringMatcher

PREFIX_BLOCK = 16  # kept sequences are matched by whole blocks of this many tokens
# CUDA-graph row counts below 16; from 16 on, every multiple of 16. No bucket of 1 row: torch.compile
# specialises a dimension of size 1, so the first call that ends on slot 0 alone would recompile the
# decode step (seconds) in the middle of training; one idle row costs nothing a step can measure.
SMALL_ROW_BUCKETS = (2, 4, 8)
LOOKAHEAD = 1  # decode steps launched before the host reads a step's tokens


class _DeviceSlots:
    """What a decode step reads and advances, one row per KV-cache slot, on the device (static
    addresses, so CUDA graphs can replay over them), and the host's mirror of the positions."""

    def __init__(self, cache: SlotKVCache, slots: int, device: torch.device):
        self.cache = cache
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(slots, **long)  # the token each slot feeds next: after a step, the one it sampled
        self.positions = torch.zeros(slots, **long)  # its position
        self.seeds = torch.zeros(slots, **long)  # the slot's request's sampling stream
        self.counters = torch.zeros(slots, **long)  # tokens its request has sampled so far
        self.logprobs = torch.zeros(slots, dtype=torch.float32, device=device)
        self.host_positions = np.zeros(slots, dtype=np.int64)

    def small_state(self) -> list[torch.Tensor]:
        return [self.ids, self.positions, self.counters]


class _DecodeGraphs:
    """The decode step captured as CUDA graphs, one per (rows bucket, attended length), over one
    call's `_DeviceSlots` (graphs hold its addresses, so they live as long as the call). `warmed`
    (the engine's, kept across calls) holds the step shapes that have run before under `context`
    (the call's slots and sampling settings): their kernels are compiled and tuned, so they are
    captured without running the step first."""

    def __init__(self, step, slots: _DeviceSlots, count: int, warmed: set, context: tuple):
        self.step = step
        self.slots = slots
        self.warmed, self.context = warmed, context
        self.buckets = sorted({b for b in SMALL_ROW_BUCKETS if b < count} | set(range(16, count, 16)) | {count})
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_s = 0.0

    def rows_for(self, rows: int) -> int:
        return next(bucket for bucket in self.buckets if bucket >= rows)

    def __call__(self, rows: int, attended: int) -> None:
        graph = self.graphs.get((rows, attended))
        if graph is None:
            graph = self._capture(rows, attended)
        graph.replay()

    def _capture(self, rows: int, attended: int) -> torch.cuda.CUDAGraph:
        """Run the step once if its shape has not run before (compiles and tunes kernels for these
        shapes, then restores the slots' state; the K/V it writes are those the replay writes), then
        capture it."""
        started = time.perf_counter()
        shape = (rows, attended, *self.context)
        if shape not in self.warmed:
            saved = [tensor.clone() for tensor in self.slots.small_state()]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.step(rows, attended)
                for tensor, value in zip(self.slots.small_state(), saved):
                    tensor.copy_(value)
            torch.cuda.current_stream().wait_stream(stream)
            self.warmed.add(shape)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(rows, attended)
        self.pool = graph.pool()
        self.graphs[rows, attended] = graph
        self.capture_s += time.perf_counter() - started
        return graph


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


def weights_fingerprint(model) -> tuple:
    """Changes whenever a parameter is updated in place (its version counter) or replaced: a kept
    KV cache is valid only for the weights that computed it."""
    return tuple((param.data_ptr(), param._version) for param in model.parameters())


@ENGINES.register("rollout")
class RolloutEngine(GenerationEngine):
    """Continuous-batching generation over the policy's own weights (module docstring)."""

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
                 should_stop: Callable[[], bool] | None = None) -> list[GenerationOutput]:
        """Continue every prompt once; a `should_stop` that turns true (a server's client left) ends the
        call between decode steps, its slots freed and outputs cut where they are."""
        check_request(prompts, params)
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
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return _Call(self, prompts, params, call_seed, matcher, kept, weights, record_routing).run(should_stop)
        finally:
            self.model.train(was_training)

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


class _Call:
    """One `generate` call: its requests, slots, host bookkeeping and device state."""

    def __init__(self, engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, call_seed: int,
                 matcher: StopStringMatcher, kept: KeptCache | None, weights: tuple, record_routing: bool = False):
        self.engine, self.params, self.matcher = engine, params, matcher
        self.record_routing = record_routing
        self.decoder = engine.decoder
        self.prompts = [list(prompt) for prompt in prompts]
        self.weights = weights
        # Per request: the kept slot and prefix length it starts from; the kept cache is released
        # before this call allocates its own when no prompt extends a kept sequence.
        self.prefixes = [kept.longest_prefix(prompt) if kept else (-1, 0) for prompt in self.prompts]
        self.kept = kept if any(length for _, length in self.prefixes) else None
        self.seeds = [request_seed(call_seed, index) for index in range(len(prompts))]
        count = len(prompts)
        self.length = max(map(len, self.prompts), default=0) + params.max_new_tokens
        if engine.decoder.exchange is not None:
            self.length = engine.group_length(self.length, params, record_routing)
        self.slot_total = engine.slot_count(count, self.length, record_routing)
        # Per request: generated tokens and log-probs so far, how many, and the finish reason.
        self.tokens = np.zeros((count, params.max_new_tokens), dtype=np.int64)
        self.logprobs = np.zeros((count, params.max_new_tokens), dtype=np.float32)
        self.generated = np.zeros(count, dtype=np.int64)
        self.finish: list[str | None] = [None] * count
        self.finished = np.zeros(count, dtype=bool)
        self.eos = np.array(sorted(engine.eos_ids), dtype=np.int64)
        self.stop_ids = np.array(params.stop_token_ids, dtype=np.int64)
        # Per slot: the request it holds (-1: free), as the host knows it.
        self.occupant = np.full(self.slot_total, -1, dtype=np.int64)
        self.holder = np.full(self.slot_total, -1, dtype=np.int64)  # the last request a slot held (its K/V stay after it finishes)
        self.prefilled_tokens = self.reused_tokens = 0
        self.free = list(range(self.slot_total))
        self.waiting = deque(range(count))
        # Per request, with record_routing: the experts of the tokens it fed through the model, copied on
        # the device out of its slot's record when it finishes (before another request takes the slot).
        self.routing: list[torch.Tensor | None] = [None] * count

    def run(self, should_stop: Callable[[], bool] | None = None) -> list[GenerationOutput]:
        if not self.slot_total:  # under expert parallelism: no rank of the group has a request
            return []
        device = self.decoder.device
        exchange = self.decoder.exchange
        cache = self.decoder.new_cache(self.slot_total, self.length, self.record_routing)
        self.slots = _DeviceSlots(cache, self.slot_total, device)
        on_gpu = device.type == "cuda"
        graphs = None
        if on_gpu and self.engine.cfg.cuda_graphs:
            context = (self.slot_total, self.length, self.params.temperature, self.params.top_p, self.params.top_k,
                       self.record_routing)
            graphs = _DecodeGraphs(self._step, self.slots, self.slot_total, self.engine.warmed_steps, context)
        buffers = [(torch.zeros(self.slot_total, dtype=torch.long, pin_memory=on_gpu),
                    torch.zeros(self.slot_total, dtype=torch.float32, pin_memory=on_gpu)) for _ in range(LOOKAHEAD + 1)]
        in_flight: deque = deque()
        steps = 0
        stopped = False
        while True:
            if not stopped and should_stop is not None and should_stop():
                stopped = True  # steps still in flight are dropped: nobody reads this call's outputs
                if exchange is None:
                    break
                self.waiting.clear()  # under expert parallelism it keeps joining its group, with no work
                self.occupant[:] = -1
                in_flight.clear()
            admitting = bool(self.waiting and self.free)
            if exchange is not None:  # lockstep (module docstring): whether any rank prefills, the step's shape
                prefilling, rows, last = exchange.agree([int(admitting), *self._ahead()])
                if not (prefilling or rows):
                    break
            elif not (self.waiting or (self.occupant >= 0).any()):
                break
            if admitting:
                self._admit()
            elif exchange is not None and prefilling:
                self.decoder.idle_prefill()
            busy = np.flatnonzero(self.occupant >= 0)
            if exchange is None:  # the step's shape from the slots now busy
                rows = int(busy[-1]) + 1 if len(busy) else 0
                last = int(self.slots.host_positions[busy].max()) if len(busy) else 0
            if rows:
                step = self.engine.cfg.attended_length_step
                attended = min(self.length, -(-(last + 1) // step) * step)
                if self.decoder.attention.reads_to_position:
                    attended = self.length  # one graph per batch size
                if graphs is not None:
                    rows = graphs.rows_for(rows)
                    graphs(rows, attended)
                else:
                    self._step(rows, attended)
                self.slots.host_positions[:rows] = np.minimum(self.slots.host_positions[:rows] + 1, self.length - 1)
                if len(busy):  # an idle step (expert parallelism) has no tokens to read
                    host_tokens, host_logprobs = buffers[steps % len(buffers)]
                    # before any admission rewrites ids
                    host_tokens[:rows].copy_(self.slots.ids[:rows], non_blocking=on_gpu)
                    host_logprobs[:rows].copy_(self.slots.logprobs[:rows], non_blocking=on_gpu)
                    done = torch.cuda.Event() if on_gpu else None
                    if done is not None:
                        done.record()
                    in_flight.append((done, host_tokens, host_logprobs, self.occupant[:rows].copy()))
                steps += 1
            while len(in_flight) > LOOKAHEAD or (in_flight and not (self.occupant >= 0).any()):
                self._read_step(*in_flight.popleft())
        if on_gpu:
            torch.cuda.synchronize(device)
        self.engine.last_call = {"decode_steps": steps, "slots": self.slot_total,
                                 "graphs_captured": len(graphs.graphs) if graphs else 0,
                                 "graph_capture_s": graphs.capture_s if graphs else 0.0,
                                 "prefilled_tokens": self.prefilled_tokens, "prefix_reused_tokens": self.reused_tokens}
        self.kept = None
        if self.engine.cfg.prefix_cache and not stopped:
            self.engine.kept = KeptCache(cache, {int(slot): self.prompts[index] + self.tokens[index, : self.generated[index] - 1].tolist()
                                                 for slot, index in enumerate(self.holder) if index >= 0}, self.weights)
        routing = self._routing_outputs() if self.record_routing and not stopped else [None] * len(self.prompts)
        return [GenerationOutput(token_ids=self.tokens[index, :n].tolist(), finish_reason=self.finish[index] or "length",
                                 logprobs=self.logprobs[index, :n].tolist() if self.params.return_logprobs else None,
                                 routing=routing[index])
                for index, n in enumerate(self.generated)]

    def _ahead(self) -> tuple[int, int]:
        """What this loop turn's decode step needs, before its admission: the rows (slots [0, highest
        busy slot], counting the lowest free ones the admission takes) and the highest position it
        feeds (an admitted prompt's is its length)."""
        busy = np.flatnonzero(self.occupant >= 0)
        highest = int(busy[-1]) if len(busy) else -1
        last = int(self.slots.host_positions[busy].max()) if len(busy) else 0
        admitted = min(len(self.waiting), len(self.free))
        if admitted:
            highest = max(highest, max(heapq.nsmallest(admitted, self.free)))
            last = max(last, max(len(self.prompts[index]) for index in islice(self.waiting, admitted)))
        return highest + 1, last

    def _take_routing(self, index: int, slot: int) -> None:
        """Copy, on the device, the experts of request `index`'s fed tokens (its prompt and every generated
        token but the last) out of `slot`: every step that computed them has been launched, and the next
        request to take the slot is prefilled after this copy."""
        fed = len(self.prompts[index]) + int(self.generated[index]) - 1
        self.routing[index] = self.slots.cache.routing.history[slot, :fed].clone()

    def _routing_outputs(self) -> list[torch.Tensor]:
        """Each request's experts per token, int16 on the CPU (one copy for all), NOT_RECORDED on its last
        generated token (`GenerationOutput.routing`)."""
        if not self.routing:
            return []
        lengths = [len(record) for record in self.routing]
        records = torch.cat(self.routing).to(device="cpu", dtype=torch.int16).split(lengths)
        last = torch.full((1, *records[0].shape[1:]), NOT_RECORDED, dtype=torch.int16)
        return [torch.cat([record, last]) for record in records]

    def _step(self, rows: int, attended: int) -> None:
        """Decode, sample and advance slots [0, rows) on the device (what the CUDA graphs capture)."""
        slots, params = self.slots, self.params
        logits = self.decoder.decode(slots.ids[:rows], slots.positions[:rows], slots.cache, attended)
        tokens, logprobs = self.engine.sample(logits, params.temperature, params.top_p, params.top_k,
                                              slots.seeds[:rows], slots.counters[:rows])
        slots.logprobs[:rows].copy_(logprobs)
        slots.ids[:rows].copy_(tokens)
        slots.positions[:rows].add_(1).clamp_(max=self.length - 1)
        slots.counters[:rows].add_(1)

    def _read_step(self, done, host_tokens, host_logprobs, occupants: np.ndarray) -> None:
        """Take a launched step's tokens for the requests that had not finished when it was launched."""
        if done is not None:
            done.synchronize()
        rows = np.flatnonzero(occupants >= 0)
        rows = rows[~self.finished[occupants[rows]]]
        if len(rows):
            self._accept(occupants[rows], host_tokens.numpy()[rows], host_logprobs.numpy()[rows])

    def _admit(self) -> None:
        """Prefill waiting requests into free slots and sample their first tokens."""
        admitted = []
        while self.waiting and self.free:
            admitted.append((self.waiting.popleft(), heapq.heappop(self.free)))
        device = self.decoder.device
        indices = [index for index, _ in admitted]
        slot_ids = torch.tensor([slot for _, slot in admitted], device=device)
        logits = self._prefill(admitted)
        seeds = torch.tensor([self.seeds[index] for index in indices], dtype=torch.long, device=device)
        tokens, logprobs = sample(logits, self.params.temperature, self.params.top_p, self.params.top_k, seeds,
                                  torch.zeros_like(seeds))
        slots = self.slots
        slots.ids[slot_ids] = tokens
        slots.positions[slot_ids] = torch.tensor([len(self.prompts[index]) for index in indices], device=device)
        slots.seeds[slot_ids] = seeds
        slots.counters[slot_ids] = 1
        for index, slot in admitted:
            self.occupant[slot] = self.holder[slot] = index
            slots.host_positions[slot] = len(self.prompts[index])
        self._accept(np.array(indices), tokens.cpu().numpy(), logprobs.cpu().numpy())

    def _prefill(self, admitted: list[tuple[int, int]]) -> torch.Tensor:
        """Prefill the admitted (request, slot) pairs; float32 logits [len(admitted), V] of their last
        prompt token. A prompt that extends a kept sequence gets its prefix's K/V copied from the kept
        cache and prefills only the rest."""
        device = self.decoder.device
        run_row: dict[tuple[int, ...], int] = {}  # prompt -> its row among the prefilled ones
        runs: list[tuple[int, int]] = []  # (request, slot) prefilled
        copies: dict[int, list[int]] = {}  # row prefilled -> slots that receive its KV rows
        rows = []  # the prefilled row of each admitted request
        for index, slot in admitted:
            key = tuple(self.prompts[index])
            if self.engine.cfg.share_prompt_prefill and key in run_row:
                copies.setdefault(run_row[key], []).append(slot)
            else:
                run_row[key] = len(runs)
                runs.append((index, slot))
            rows.append(run_row[key])
        starts = [self.prefixes[index][1] for index, _ in runs]
        reused = [(self.prefixes[index][0], slot) for (index, slot), start in zip(runs, starts) if start]
        if reused:
            self.slots.cache.copy_from(self.kept.cache, *map(list, zip(*reused)), max(starts))
        tails = [self.prompts[index][start:] for (index, _), start in zip(runs, starts)]
        ids = torch.full((len(runs), max(map(len, tails))), self.engine.pad_id, dtype=torch.long)
        for row, tail in enumerate(tails):
            ids[row, : len(tail)] = torch.tensor(tail)
        self.prefilled_tokens += sum(map(len, tails))
        self.reused_tokens += sum(starts)
        lengths = torch.tensor([len(tail) for tail in tails])
        slots = torch.tensor([slot for _, slot in runs])
        logits = self.decoder.prefill(ids.to(device), lengths.to(device), slots.to(device), self.slots.cache,
                                      torch.tensor(starts, device=device))
        if copies:  # one copy for every shared prompt (positions past a shorter prompt are rewritten before use)
            sources = [runs[row][1] for row, targets in copies.items() for _ in targets]
            targets = [slot for slot_list in copies.values() for slot in slot_list]
            self.slots.cache.copy_from(self.slots.cache, sources, targets,
                                       max(len(self.prompts[runs[row][0]]) for row in copies))
        return logits[torch.tensor(rows, device=device)]

    def _accept(self, requests: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Append one token to each of `requests`; finish those it ends (hf.finish_reason's order:
        EOS, then a stop id or stop string, then the length cap) and free their slots."""
        params = self.params
        count = self.generated[requests]
        self.tokens[requests, count] = tokens
        self.logprobs[requests, count] = logprobs
        self.generated[requests] = count = count + 1
        eos = np.zeros(len(requests), dtype=bool) if params.ignore_eos else np.isin(tokens, self.eos)
        stop = np.isin(tokens, self.stop_ids)
        if self.matcher:
            for i in np.flatnonzero(~eos & ~stop & self.matcher.may_complete(tokens)):
                stop[i] = self.matcher.completed_by_last_token(self.tokens[requests[i], : count[i]].tolist())
        length = count >= params.max_new_tokens
        for i in np.flatnonzero(eos | stop | length):
            index = int(requests[i])
            self.finish[index] = "eos" if eos[i] else "stop" if stop[i] else "length"
            self.finished[index] = True
            slot = int(np.flatnonzero(self.occupant == index)[0])
            if self.record_routing:
                self._take_routing(index, slot)
            self.occupant[slot] = -1
            heapq.heappush(self.free, slot)
