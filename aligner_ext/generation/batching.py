"""Continuous batching over one preallocated KV cache, the machinery a `generate` call of the rollout
engine (rollout.py, whose module docstring walks through it) and a turn session (turns.py) share:
requests admitted into free slots and prefilled (each from the position its slot already holds, with
identical prompts of one admission prefilled once), the decode step over the busy slots (on a GPU
replayed from CUDA graphs and read LOOKAHEAD steps after its launch), and the host's bookkeeping of
each step's tokens and finishes (EOS, stop ids and strings, each request's token cap).

The work runs under torch.inference_mode only: the decoder computes from the weights, never through
the modules' forward, so the policy's train/eval mode is left alone (switching it walks every module,
milliseconds at 28 layers: too much for each step of a turn session)."""

from __future__ import annotations

import time
import weakref
from collections import deque
from contextlib import contextmanager

import numpy as np
import torch

from aligner_ext.generation.base import NOT_RECORDED, GenerationOutput, SamplingParams
from aligner_ext.generation.decoder import SlotKVCache
from aligner_ext.generation.sampler import sample
from aligner_ext.generation.stopping import StopStringMatcher

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
        self.active = torch.zeros(slots, **long)  # 1 while a request generates in the slot (decode's `seen`)
        self.host_positions = np.zeros(slots, dtype=np.int64)

    def small_state(self) -> list[torch.Tensor]:
        return [self.ids, self.positions, self.counters]


class _DecodeGraphs:
    """The decode step captured as CUDA graphs, one per (rows bucket, attended length), over one
    call's `_DeviceSlots` (graphs hold its addresses, so they live as long as the call). `warmed`
    (the engine's, kept across calls) holds the step shapes that have run before under `context`
    (the call's slots and sampling settings): their kernels are compiled and tuned, so they are
    captured without running the step first.

    `step` is its batcher's method, held weakly: a strong one would close a cycle (batcher -> graphs ->
    method -> batcher) that only the cyclic collector frees, so every finished call's KV cache and graph
    pool stayed allocated until a full collection, which long-lived processes run rarely: at 1.5B, a
    step's 256 x 768 positions (5.25 GiB) piled up at every step on the GPU."""

    def __init__(self, step, slots: _DeviceSlots, count: int, warmed: set, context: tuple):
        self._step = weakref.WeakMethod(step)
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
                self._step()(rows, attended)
                for tensor, value in zip(self.slots.small_state(), saved):
                    tensor.copy_(value)
            torch.cuda.current_stream().wait_stream(stream)
            self.warmed.add(shape)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the capture forbids unsafe CUDA calls in this thread only, so that training may run in
        # another while generation runs ahead (experience/ahead.py); alone in its process it is the same
        beside_training = torch.cuda.current_stream() != torch.cuda.default_stream()
        with (capture_beside_training(graph, self.pool) if beside_training
              else torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")):
            self._step()(rows, attended)
        self.pool = graph.pool()
        self.graphs[rows, attended] = graph
        self.capture_s += time.perf_counter() - started
        return graph



@contextmanager
def capture_beside_training(graph: torch.cuda.CUDAGraph, pool):
    """torch.cuda.graph's capture (on a side stream, thread_local) without its prologue, for generation
    on its own stream while another thread trains (experience/ahead.py): the prologue synchronises the
    whole device and empties the allocator's cache, so at every capture it would wait for training's
    queued kernels and free the blocks training is about to reuse. Without it, a capture that needs the
    memory the cache holds fails (lower generator.rollout.kv_cache_memory_share)."""
    with torch.cuda.stream(torch.cuda.Stream()):
        graph.capture_begin(*([] if pool is None else [pool]), capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def weights_fingerprint(model) -> tuple:
    """Changes whenever a parameter is updated in place (its version counter) or replaced: a kept
    KV cache is valid only for the weights that computed it."""
    return tuple((param.data_ptr(), param._version) for param in model.parameters())


def routing_on_host(records: list[torch.Tensor]) -> list[torch.Tensor]:
    """Requests' experts per fed token (device copies, `SlotBatcher._routing_of`) as
    `GenerationOutput.routing`: int16 on the CPU (one copy for all), with NOT_RECORDED for the last
    generated token, which is sampled and never fed back."""
    if not records:
        return []
    lengths = [len(record) for record in records]
    on_host = torch.cat(records).to(device="cpu", dtype=torch.int16).split(lengths)
    last = torch.full((1, *on_host[0].shape[1:]), NOT_RECORDED, dtype=torch.int16)
    return [torch.cat([record, last]) for record in on_host]


class SlotBatcher:
    """Requests decoded together over one SlotKVCache of `slot_total` sequences of `length` positions.

    A request is an index the subclass chooses and never reuses (a step read after its request finished
    is then never taken for the slot's next request); the subclass keeps, per request, `prompts`,
    `seeds` (its sampling stream) and `max_new_tokens`, admits requests with `_admit`, and is told each
    finish by `_finish`. A slot keeps its latest request's generated tokens (`tokens`, `generated`) and
    the K/V of all its tokens but the last until another request takes it. `_prefix_starts` says how
    many positions of a prefilled prompt its slot already holds."""

    def __init__(self, engine, params: SamplingParams, matcher: StopStringMatcher, slot_total: int, length: int,
                 width: int, record_routing: bool = False):
        self.engine, self.params, self.matcher = engine, params, matcher
        self.decoder = engine.decoder
        self.on_gpu = self.decoder.device.type == "cuda"
        self.record_routing = record_routing
        self.slot_total, self.length = slot_total, length
        self.eos = np.array(sorted(engine.eos_ids), dtype=np.int64)
        self.stop_ids = np.array(params.stop_token_ids, dtype=np.int64)
        # Per slot: the request it holds (-1: free) as the host knows it, the last request it held, and
        # that request's generated tokens, log-probs, their count and its cap (at most `width`).
        self.occupant = np.full(slot_total, -1, dtype=np.int64)
        self.holder = np.full(slot_total, -1, dtype=np.int64)
        self.tokens = np.zeros((slot_total, width), dtype=np.int64)
        self.logprobs = np.zeros((slot_total, width), dtype=np.float32)
        self.generated = np.zeros(slot_total, dtype=np.int64)
        self.caps = np.zeros(slot_total, dtype=np.int64)
        self.prefilled_tokens = self.reused_tokens = 0
        self.steps = 0

    def _allocate(self) -> None:
        """The cache, the device state of its slots, the decode step's CUDA graphs (a GPU) and the
        pinned host buffers its tokens are read into."""
        cache = self.decoder.new_cache(self.slot_total, self.length, self.record_routing)
        self.slots = _DeviceSlots(cache, self.slot_total, self.decoder.device)
        self.graphs = None
        if self.on_gpu and self.engine.cfg.cuda_graphs:
            context = (self.slot_total, self.length, self.params.temperature, self.params.top_p, self.params.top_k,
                       self.record_routing)
            self.graphs = _DecodeGraphs(self._step, self.slots, self.slot_total, self.engine.warmed_steps, context)
        self.buffers = [(torch.zeros(self.slot_total, dtype=torch.long, pin_memory=self.on_gpu),
                         torch.zeros(self.slot_total, dtype=torch.float32, pin_memory=self.on_gpu))
                        for _ in range(LOOKAHEAD + 1)]
        self.in_flight: deque = deque()

    def _busy_shape(self) -> tuple[int, int]:
        """The decode step's rows (slots [0, highest busy slot]) and the highest position it feeds."""
        busy = np.flatnonzero(self.occupant >= 0)
        if not len(busy):
            return 0, 0
        return int(busy[-1]) + 1, int(self.slots.host_positions[busy].max())

    def _decode(self, rows: int, last: int, read: bool = True) -> None:
        """Launch one decode step over slots [0, rows) and, when `read`, queue the reading of its tokens
        (an idle step under expert parallelism has none)."""
        step = self.engine.cfg.attended_length_step
        attended = min(self.length, -(-(last + 1) // step) * step)
        if self.decoder.attention.reads_to_position:
            attended = self.length  # one graph per batch size
        if self.graphs is not None:
            rows = self.graphs.rows_for(rows)
            self.graphs(rows, attended)
        else:
            self._step(rows, attended)
        self.slots.host_positions[:rows] = np.minimum(self.slots.host_positions[:rows] + 1, self.length - 1)
        if read:
            host_tokens, host_logprobs = self.buffers[self.steps % len(self.buffers)]
            # before any admission rewrites ids
            host_tokens[:rows].copy_(self.slots.ids[:rows], non_blocking=self.on_gpu)
            host_logprobs[:rows].copy_(self.slots.logprobs[:rows], non_blocking=self.on_gpu)
            done = torch.cuda.Event() if self.on_gpu else None
            if done is not None:
                done.record()
            self.in_flight.append((done, host_tokens, host_logprobs, self.occupant[:rows].copy()))
        self.steps += 1

    def _read_launched(self) -> None:
        """Read the launched steps but the last LOOKAHEAD (all of them once no slot is busy)."""
        while len(self.in_flight) > LOOKAHEAD or (self.in_flight and not (self.occupant >= 0).any()):
            self._read_step(*self.in_flight.popleft())

    def _step(self, rows: int, attended: int) -> None:
        """Decode, sample and advance slots [0, rows) on the device (what the CUDA graphs capture)."""
        slots, params = self.slots, self.params
        logits = self.decoder.decode(slots.ids[:rows], slots.positions[:rows], slots.cache, attended,
                                     slots.positions[:rows] * slots.active[:rows])
        tokens, logprobs = self.engine.sample(logits, params.temperature, params.top_p, params.top_k,
                                              slots.seeds[:rows], slots.counters[:rows])
        slots.logprobs[:rows].copy_(logprobs)
        slots.ids[:rows].copy_(tokens)
        slots.positions[:rows].add_(1).clamp_(max=self.length - 1)
        slots.counters[:rows].add_(1)

    def _read_step(self, done, host_tokens, host_logprobs, occupants: np.ndarray) -> None:
        """Take a launched step's tokens for the requests still in the slots they held at its launch
        (a request leaves its slot when it finishes)."""
        if done is not None:
            done.synchronize()
        rows = np.flatnonzero((occupants >= 0) & (self.occupant[: len(occupants)] == occupants))
        if len(rows):
            self._accept(rows, host_tokens.numpy()[rows], host_logprobs.numpy()[rows])

    def _admit(self, admitted: list[tuple[int, int]]) -> None:
        """Prefill the (request, slot) pairs and sample their first tokens."""
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
        slots.active[slot_ids] = 1
        for index, slot in admitted:
            self.occupant[slot] = self.holder[slot] = index
            self.generated[slot] = 0
            self.caps[slot] = self.max_new_tokens[index]
            slots.host_positions[slot] = len(self.prompts[index])
        self._accept(np.array([slot for _, slot in admitted]), tokens.cpu().numpy(), logprobs.cpu().numpy())

    def _prefill(self, admitted: list[tuple[int, int]]) -> torch.Tensor:
        """Prefill the admitted (request, slot) pairs; float32 logits [len(admitted), V] of their last
        prompt token. Each prefilled prompt starts at the position `_prefix_starts` gives (its slot holds
        the K/V before it); with `share_prompt_prefill` identical prompts are prefilled once and their
        KV rows copied."""
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
        starts = self._prefix_starts(runs)
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

    def _prefix_starts(self, runs: list[tuple[int, int]]) -> list[int]:
        """Per prefilled (request, slot): the positions of its prompt whose K/V the slot already holds
        (nothing, by default)."""
        return [0] * len(runs)

    def _accept(self, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Append one token to the request of each of `slots`; finish those it ends (hf.finish_reason's
        order: EOS, then a stop id or stop string, then the request's cap) and free their slots."""
        count = self.generated[slots]
        self.tokens[slots, count] = tokens
        self.logprobs[slots, count] = logprobs
        self.generated[slots] = count = count + 1
        eos = np.zeros(len(slots), dtype=bool) if self.params.ignore_eos else np.isin(tokens, self.eos)
        stop = np.isin(tokens, self.stop_ids)
        if self.matcher:
            for i in np.flatnonzero(~eos & ~stop & self.matcher.may_complete(tokens)):
                stop[i] = self.matcher.completed_by_last_token(self.tokens[slots[i], : count[i]].tolist())
        length = count >= self.caps[slots]
        finished = np.flatnonzero(eos | stop | length)
        if len(finished):
            self._idle(slots[finished])
        for i in finished:
            slot = int(slots[i])
            index = int(self.occupant[slot])
            self.occupant[slot] = -1
            self._finish(index, slot, "eos" if eos[i] else "stop" if stop[i] else "length")

    def _idle(self, slots: np.ndarray) -> None:
        """No request generates in `slots` any more: their decode rows attend to one position (the
        steps already launched still read them whole)."""
        with torch.inference_mode():  # the slots' tensors are inference tensors; `release` comes from outside
            self.slots.active[torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.decoder.device)] = 0

    def _routing_of(self, slot: int, fed: int) -> torch.Tensor:
        """A copy, on the device, of the experts of the first `fed` tokens `slot` holds (a finished
        request's prompt and generated tokens but the last): every step that computed them has been
        launched, and the slot's next request writes its positions only after this copy."""
        return self.slots.cache.routing.history[slot, :fed].clone()

    def _output(self, slot: int, finish_reason: str) -> GenerationOutput:
        """What the slot's latest request generated."""
        n = int(self.generated[slot])
        return GenerationOutput(token_ids=self.tokens[slot, :n].tolist(), finish_reason=finish_reason,
                                logprobs=self.logprobs[slot, :n].tolist() if self.params.return_logprobs else None)

    def _finish(self, index: int, slot: int, finish_reason: str) -> None:
        """Request `index` finished in `slot` (no longer its occupant; its tokens still there)."""
        raise NotImplementedError
