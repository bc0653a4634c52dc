"""Generation with the policy's own transformers module: a KV-cached sampling loop, token ids only.

The engine holds a reference to the policy model (no copy), so `update_weights` only swaps the
reference and sampling always sees the current weights.

Per chunk of at most `cfg.batch_size` prompts:
  1. left-pad the prompts, on a GPU to a multiple of 16 columns (so that a new prompt width compiles no
     Triton kernel again, aligner_ext/widths.py); `position_ids = cumsum(attention_mask) - 1`, so
     each sequence's first real token sits at position 0 whatever its padding;
  2. one forward over the padded prompts fills the KV cache (`cache`); afterwards each
     step feeds only the newest token, its position (previous + 1) and a mask grown by one column;
  3. each step samples from the float32 logits of the last column:
       temperature 0:  x = argmax(z)
       otherwise:      p = softmax(z / T); top-k keeps the k most likely tokens, then top-p the
                       smallest set of most likely tokens whose mass reaches top_p (always at least
                       one), renormalised; x ~ p
  4. a row finishes on an EOS id ("eos", EOS kept; unless `params.ignore_eos`), on a stop token id
     or a token that completes a stop string ("stop", kept, see stopping.py), or at max_new_tokens
     ("length"). Finished rows are fed pad
     tokens that are never returned; the loop ends when every row has finished.

Decisions:
  - Log-probs are those of the sampled token under the distribution it was drawn from, after
    temperature and top-p renormalisation: what an importance ratio against the sampler needs.
    Greedy decoding has no sampling distribution; it reports the temperature-1 log-softmax of the
    chosen token (the policy's own log-prob). Pinned by tests/unit/generation/test_hf_engine.py.
  - `params.seed` seeds one torch.Generator for the whole call, consumed chunk after chunk: a call
    is reproducible for a given seed, prompt order and `batch_size`.
  - EOS ids are the tokenizer's eos_token_id plus the model's generation_config.eos_token_id.
  - Stop strings are matched on the text decoded with `skip_special_tokens=True`, as a reader of
    the response sees it; so a special token (e.g. "<|im_end|>") cannot itself be a stop string:
    list its id as EOS instead.
  - The prompt forward asks for last-column logits only (`logits_to_keep=1`) when the model
    accepts it: full prompt logits would take B * P * vocab floats.
  - `reuse_prompt_prefill` (off by default): the prompt forward runs once per distinct prompt of
    a chunk and the duplicates get copies of its last logits and KV-cache rows
    (`Cache.batch_select_indices`). GRPO groups and MTPO's round 2 (H continuations of one
    prompt + answer) repeat prompts, and on a CPU the prompt forward is most of a round's cost.
    Off by default because batched float arithmetic is not bitwise independent of the batch
    size, so a run's samples may differ in rare near-ties from a run without it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch

from aligner_ext.data.templating import left_pad
from aligner_ext.generation.base import ENGINES, GenerationEngine, GenerationOutput, SamplingParams, check_sampling
from aligner_ext.generation.settings import HFEngineConfig
from aligner_ext.generation.stopping import StopStringMatcher
from aligner_ext.widths import width_multiple

logger = logging.getLogger(__name__)


@ENGINES.register("hf")
class HFGenerationEngine(GenerationEngine):
    """Samples from a transformers causal LM shared with the policy.

    Args:
        model: a causal LM called as `model(input_ids=, attention_mask=, position_ids=,
            cache=, use_cache=True)` returning `.logits` [B, S, V] and `.cache`, or with
            `past_key_values` for both where its forward has no `cache` argument (transformers
            before the rename).
        tokenizer: supplies `eos_token_id`, `pad_token_id` and `decode` (stop strings only).
        cfg: engine settings.
    """

    def __init__(self, model, tokenizer, cfg: HFEngineConfig):
        if cfg.batch_size < 1:
            raise ValueError(f"HFEngineConfig.batch_size must be >= 1, got {cfg.batch_size}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        # Padded positions are masked out of attention, so any valid id serves as padding.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.update_weights(model)

    def update_weights(self, policy_model) -> None:
        """Keep a reference to the policy's module (shared memory: nothing is copied)."""
        self.model = policy_model
        self.eos_ids = eos_ids_of(self.tokenizer, policy_model)
        if not self.eos_ids:
            logger.warning("no EOS id on the tokenizer or generation_config: sequences end only by "
                           "stop string or max_new_tokens")
        arguments = inspect.signature(policy_model.forward).parameters
        self._keeps_last_logits = "logits_to_keep" in arguments
        # transformers renamed the KV cache argument `past_key_values` to `cache` and warns on the old name
        self._cache_argument = "cache" if "cache" in arguments else "past_key_values"

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 should_stop: Callable[[], bool] | None = None) -> list[GenerationOutput]:
        """Continue every prompt once; output i belongs to prompt i. A `should_stop` that turns true (a
        server's client left) ends the call after the current step, outputs cut where they are."""
        check_request(prompts, params)
        if not prompts:
            return []
        device = _device_of(self.model)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        matcher = StopStringMatcher(params.stop, self._decode)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                outputs: list[GenerationOutput] = []
                for begin in range(0, len(prompts), self.cfg.batch_size):
                    chunk = prompts[begin : begin + self.cfg.batch_size]
                    outputs.extend(self._generate_chunk(chunk, params, matcher, generator, device, should_stop))
        finally:
            self.model.train(was_training)
        return outputs

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate_chunk(self, prompts, params, matcher, generator, device, should_stop) -> list[GenerationOutput]:
        """The cached sampling loop for at most `batch_size` prompts."""
        padded = left_pad(prompts, self.pad_id, width_multiple(device))  # [B, P]: 16k wide on a GPU
        input_ids, attention_mask = (t.to(device) for t in padded)
        attention_mask = attention_mask.long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        batch = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        reasons: list[str | None] = [None] * batch
        logits, cache = self._prefill(prompts, input_ids, attention_mask, position_ids)
        for step in range(params.max_new_tokens):
            next_ids, next_logprobs = sample_next(logits, params, generator)
            for row, (token, logprob) in enumerate(zip(next_ids.tolist(), next_logprobs.tolist())):
                if reasons[row] is None:
                    tokens[row].append(token)
                    logprobs[row].append(logprob)
                    reasons[row] = finish_reason(tokens[row], self.eos_ids, matcher, params)
            if all(reason is not None for reason in reasons) or step + 1 == params.max_new_tokens:
                break
            if should_stop is not None and should_stop():
                break
            finished = torch.tensor([reason is not None for reason in reasons], device=device)
            next_ids = next_ids.masked_fill(finished, self.pad_id)[:, None]  # [B, 1]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1  # [B, 1]
            out = self._forward(input_ids=next_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=cache)
            logits, cache = out.logits[:, -1, :].float(), cache_of(out)
        return [
            GenerationOutput(token_ids=tokens[row], finish_reason=reasons[row] or "length",
                             logprobs=logprobs[row] if params.return_logprobs else None)
            for row in range(batch)
        ]

    def _prefill(self, prompts, input_ids, attention_mask, position_ids):
        """The prompt forward: (last-column logits [B, V] float32, KV cache of the B rows).

        With `reuse_prompt_prefill`, only the first occurrence of each distinct prompt is run and
        its logits and cache rows are copied to the rows that repeat it.
        """
        extra = {"logits_to_keep": 1} if self._keeps_last_logits else {}
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(prompt), row) for row, prompt in enumerate(prompts)]
        if not self.cfg.reuse_prompt_prefill or len(first) == len(prompts):
            out = self._forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=None, **extra)
            return out.logits[:, -1, :].float(), cache_of(out)
        distinct = list(first.values())  # rows run, in order of first occurrence
        rank = {row: index for index, row in enumerate(distinct)}
        expand = torch.tensor([rank[row] for row in source], device=input_ids.device)  # [B] into the distinct rows
        run = torch.tensor(distinct, device=input_ids.device)
        out = self._forward(input_ids=input_ids[run], attention_mask=attention_mask[run],
                            position_ids=position_ids[run], cache=None, **extra)
        cache = cache_of(out)
        if not hasattr(cache, "batch_select_indices"):
            raise TypeError(f"generator.hf.reuse_prompt_prefill needs a KV cache with batch_select_indices; "
                            f"{type(self.model).__name__} returned {type(cache).__name__}")
        cache.batch_select_indices(expand)
        return out.logits[:, -1, :].float()[expand], cache

    def _forward(self, cache, **inputs):
        """One cached forward of the model, the KV cache passed under the name its forward takes."""
        return self.model(**inputs, **{self._cache_argument: cache}, use_cache=True)


def cache_of(output):
    """The KV cache a forward returned: `.cache`, or `.past_key_values` in transformers before the
    rename (where reading the old name on newer versions would warn)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: [B, V] float32, the last position's logits.
    Returns:
        token ids [B] int64 and their log-probs [B] float32 (see the module docstring for which
        distribution).
    """
    if params.temperature == 0:
        token_ids = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
    else:
        log_probs = filtered_log_probs(logits, params.temperature, params.top_k, params.top_p)
        token_ids = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return token_ids, log_probs.gather(-1, token_ids[:, None]).squeeze(-1)


def finish_reason(generated: list[int], eos_ids: set[int], matcher: StopStringMatcher,
                  params: SamplingParams) -> str | None:
    """The finish reason ("eos" or "stop") if the newest of `generated` ends the sequence, else None."""
    if not params.ignore_eos and generated[-1] in eos_ids:
        return "eos"
    if generated[-1] in params.stop_token_ids or (matcher and matcher.completed_by_last_token(generated)):
        return "stop"
    return None


def filtered_log_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs [B, V] of the distribution sampled from: logits / temperature, then top-k, then
    top-p, renormalised (-inf outside the kept tokens)."""
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    log_probs = torch.log_softmax(scaled, dim=-1)
    return nucleus(log_probs, top_p) if top_p < 1.0 else log_probs


def nucleus(log_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p filter: keep the smallest set of most likely tokens whose mass reaches `top_p`.

    A token is kept when the mass of the tokens ranked above it is still below `top_p`, so the
    most likely token is always kept. Returns [B, V] log-probs renormalised over the kept set,
    -inf elsewhere.
    """
    sorted_log_probs, order = log_probs.sort(dim=-1, descending=True)
    mass_before = sorted_log_probs.exp().cumsum(dim=-1) - sorted_log_probs.exp()
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    kept = log_probs.masked_fill(drop, float("-inf"))
    return kept - kept.logsumexp(dim=-1, keepdim=True)


def eos_ids_of(tokenizer, model) -> set[int]:
    """The tokenizer's EOS id and any in the model's generation_config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    return ids


def _device_of(model) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def check_request(prompts: list[list[int]], params: SamplingParams) -> None:
    """Reject requests the loop cannot serve, naming the offending field or prompt."""
    check_sampling("SamplingParams.", "max_new_tokens", params.max_new_tokens, params.temperature, params.top_p)
    if params.top_k < 0:
        raise ValueError(f"SamplingParams.top_k must be >= 0, got {params.top_k}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
