"""The rollout engine: continuous batching over a preallocated KV cache, on the policy's own modules.

`generate` serves one call at a time, as the loop asks:
  1. allocate a `SlotKVCache` for the call (slots = min(max_batch_size, requests, what fits in
     `kv_cache_memory_share` of free GPU memory), length = longest prompt + max_new_tokens); it
     is freed when the call returns, so training never shares memory with it;
  2. admit waiting requests, in order, into free slots (lowest first) and prefill them together;
     requests with the same prompt ids in one admission are prefilled once and the KV rows copied
     (`share_prompt_prefill`: a GRPO group's n samples, MTPO's H continuations);
  3. decode one token for slots [0, highest busy slot]; a finished sequence frees its slot at once
     and the next waiting request takes it at the next admission;
  4. repeat until every request has finished.

Sampling (sampler.py) draws each request from its own stream, seeded by (call seed, request index),
so its tokens do not depend on which requests share its batch, on the slot count or on the
prefill sharing. Finishing: EOS (unless `ignore_eos`), a stop token id or stop string ("stop"), or
`max_new_tokens` ("length"); EOS and stops are kept, as in the HF engine (hf.py), whose semantics
this engine follows token for token (tests/unit/generation/test_rollout_engine.py).

Runs Llama / Qwen2 / Qwen3 decoders (decoder.py) in the policy's dtype: bf16 on a GPU, float32 on
the CPU. Not yet: CUDA-graph capture of the decode step, paged blocks, a cache kept across calls
(MTPO's round 2 prefills its prompt + answer again).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import torch

from aligner_ext.generation.base import ENGINES, GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.decoder import HFDecoder
from aligner_ext.generation.hf import check_request, eos_ids_of, finish_reason
from aligner_ext.generation.sampler import request_seed, sample
from aligner_ext.generation.stopping import StopStringMatcher


@dataclass
class RolloutEngineConfig:
    """Settings of the rollout engine (generation/rollout.py)."""

    max_batch_size: int = 256  # KV-cache slots: sequences decoded together
    kv_cache_memory_share: float = 0.5  # on a GPU, the share of free memory the KV cache may take (fewer slots if it does not fit)
    share_prompt_prefill: bool = True  # prefill identical prompts of one admission once and copy their KV rows


@dataclass
class _Request:
    """One prompt of a call and what it has generated so far."""

    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


@ENGINES.register("rollout")
class RolloutEngine(GenerationEngine):
    """Continuous-batching generation over the policy's own modules (module docstring)."""

    def __init__(self, model, tokenizer, cfg: RolloutEngineConfig):
        if cfg.max_batch_size < 1:
            raise ValueError(f"generator.rollout.max_batch_size must be >= 1, got {cfg.max_batch_size}")
        if not 0 < cfg.kv_cache_memory_share <= 1:
            raise ValueError(f"generator.rollout.kv_cache_memory_share must be in (0, 1], got {cfg.kv_cache_memory_share}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.update_weights(model)

    def update_weights(self, policy_model) -> None:
        """Run the policy's module itself (nothing is copied)."""
        self.decoder = HFDecoder(policy_model)
        self.model = policy_model
        self.eos_ids = eos_ids_of(self.tokenizer, policy_model)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        check_request(prompts, params)
        if not prompts:
            return []
        call_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        requests = [_Request(list(prompt), request_seed(call_seed, index)) for index, prompt in enumerate(prompts)]
        matcher = StopStringMatcher(params.stop, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                self._run(requests, params, matcher)
        finally:
            self.model.train(was_training)
        return [GenerationOutput(token_ids=r.tokens, finish_reason=r.finish or "length",
                                 logprobs=r.logprobs if params.return_logprobs else None) for r in requests]

    def _slots(self, count: int, length: int) -> int:
        """How many sequences the call's cache holds."""
        slots = min(self.cfg.max_batch_size, count)
        if self.decoder.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.decoder.device)
            fits = int(free * self.cfg.kv_cache_memory_share) // (self.decoder.cache_bytes_per_slot_token() * length)
            if fits < 1:
                raise RuntimeError(f"no KV-cache slot of {length} tokens fits in {self.cfg.kv_cache_memory_share:.0%} "
                                   f"of the {free / 2**30:.1f} GiB free; raise generator.rollout.kv_cache_memory_share "
                                   "or shorten prompts / max_new_tokens")
            slots = min(slots, fits)
        return slots

    def _run(self, requests: list[_Request], params: SamplingParams, matcher: StopStringMatcher) -> None:
        length = max(len(r.prompt) for r in requests) + params.max_new_tokens
        slots = self._slots(len(requests), length)
        cache = self.decoder.new_cache(slots, length)
        device = self.decoder.device
        waiting = deque(range(len(requests)))
        free = list(range(slots))
        busy: dict[int, int] = {}  # slot -> request index

        def release() -> None:
            for slot in [slot for slot, index in busy.items() if requests[index].finish is not None]:
                del busy[slot]
                heapq.heappush(free, slot)

        while waiting or busy:
            release()
            admitted = []
            while waiting and free:
                admitted.append((waiting.popleft(), heapq.heappop(free)))
            if admitted:
                logits = self._prefill(requests, admitted, cache)
                busy.update({slot: index for index, slot in admitted})
                self._sample(requests, [index for index, _ in admitted], logits, params, matcher)
                release()
            if not busy:
                continue
            rows = max(busy) + 1
            ids = torch.full((rows,), self.pad_id, dtype=torch.long)
            positions = torch.zeros(rows, dtype=torch.long)
            for slot, index in busy.items():
                request = requests[index]
                ids[slot] = request.tokens[-1]
                positions[slot] = len(request.prompt) + len(request.tokens) - 1
            logits = self.decoder.decode(ids.to(device), positions.to(device), cache)
            order = sorted(busy)
            self._sample(requests, [busy[slot] for slot in order], logits[torch.tensor(order, device=device)],
                         params, matcher)

    def _prefill(self, requests: list[_Request], admitted: list[tuple[int, int]], cache) -> torch.Tensor:
        """Prefill the admitted (request, slot) pairs; float32 logits [len(admitted), V] of their last prompt token."""
        device = self.decoder.device
        run_row: dict[tuple[int, ...], int] = {}  # prompt -> its row among the prefilled ones
        runs: list[tuple[list[int], int]] = []  # (prompt, slot) prefilled
        copies: dict[int, list[int]] = {}  # row prefilled -> slots that receive its KV rows
        rows = []  # the prefilled row of each admitted request
        for index, slot in admitted:
            prompt = requests[index].prompt
            key = tuple(prompt)
            if self.cfg.share_prompt_prefill and key in run_row:
                copies.setdefault(run_row[key], []).append(slot)
            else:
                run_row[key] = len(runs)
                runs.append((prompt, slot))
            rows.append(run_row[key])
        width = max(len(prompt) for prompt, _ in runs)
        ids = torch.full((len(runs), width), self.pad_id, dtype=torch.long)
        for row, (prompt, _) in enumerate(runs):
            ids[row, : len(prompt)] = torch.tensor(prompt)
        lengths = torch.tensor([len(prompt) for prompt, _ in runs])
        slots = torch.tensor([slot for _, slot in runs])
        logits = self.decoder.prefill(ids.to(device), lengths.to(device), slots.to(device), cache)
        for row, targets in copies.items():
            prompt, slot = runs[row]
            cache.copy_prefix(slot, targets, len(prompt))
        return logits[torch.tensor(rows, device=device)]

    def _sample(self, requests: list[_Request], indices: list[int], logits: torch.Tensor, params: SamplingParams,
                matcher: StopStringMatcher) -> None:
        """Draw the next token of each request of `indices` (rows of `logits`) and check its finish."""
        device = logits.device
        seeds = torch.tensor([requests[i].seed for i in indices], dtype=torch.long, device=device)
        counters = torch.tensor([len(requests[i].tokens) for i in indices], dtype=torch.long, device=device)
        token_ids, logprobs = sample(logits, params.temperature, params.top_p, params.top_k, seeds, counters)
        for index, token, logprob in zip(indices, token_ids.tolist(), logprobs.tolist()):
            request = requests[index]
            request.tokens.append(token)
            request.logprobs.append(logprob)
            request.finish = finish_reason(request.tokens, self.eos_ids, matcher, params)
            if request.finish is None and len(request.tokens) == params.max_new_tokens:
                request.finish = "length"
