"""The OpenAI-compatible request and response shapes `aligner-ext serve` speaks.

Token in, token out: a completion prompt may be token ids (one list or a list of lists), and every
choice carries the generated ids as `token_ids` (the field vLLM returns with `return_token_ids`), so
a trainer never re-tokenises text. `finish_reason` is "stop" or "length" as OpenAI defines it;
`stop_reason` tells an EOS (None) from a stop string or stop token id (that string or id), as vLLM
does. Log-probs are those of the sampled tokens only (`logprobs` 0 or 1; top-k alternatives are not
served). Fields other servers accept and these models do not know are ignored. Numbers must be
finite; as vLLM does, a temperature below SAMPLING_EPS samples greedily and a top_p below it keeps
the most likely token only, and a seed is a signed 64-bit integer. Every completion response carries
`metadata.weight_version`, as SGLang's does (a string): the version of the weights its tokens were
sampled under, the one the latest weight push gave (its `weight_version`), else the count of updates.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aligner_ext.generation.base import GenerationOutput, SamplingParams

SAMPLING_EPS = 1e-5  # vLLM's: smaller temperatures are greedy (dividing logits by them overflows)


class SamplingFields(BaseModel):
    """Sampling settings shared by completions and chat completions (OpenAI names; vLLM's extras)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extra; 0 or -1 disables it
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extra
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False  # vLLM's extra
    stream: bool = False

    def sampling_params(self, return_logprobs: bool) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_tokens, temperature=0.0 if self.temperature < SAMPLING_EPS else self.temperature,
            top_p=max(self.top_p, SAMPLING_EPS),
            top_k=max(self.top_k, 0), stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            return_logprobs=return_logprobs, seed=self.seed, ignore_eos=self.ignore_eos,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False


class DiskWeightsRequest(BaseModel):
    """SGLang's /update_weights_from_disk payload."""

    model_path: str
    load_format: str | None = None
    # SGLang's (a string there): the policy version of the pushed weights, which the server reports from then
    # on; here a count (digits accepted). Unset: the server counts its updates
    weight_version: int | None = Field(None, ge=0)


class AbortRequest(BaseModel):
    """SGLang's /abort_request payload (`rid`: one request's id, which this server does not give; served:
    `abort_all`)."""

    rid: str = ""
    abort_all: bool = False


class WeightGroupRequest(BaseModel):
    """SGLang's /init_weights_update_group payload."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_sync"
    backend: str = "nccl"


class DistributedWeightsRequest(BaseModel):
    """SGLang's /update_weights_from_distributed payload: several tensors (names, dtypes, shapes) or one
    (name, dtype, shape), broadcast from rank 0 of the weight group in this order."""

    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    group_name: str = "weight_sync"
    weight_version: int | None = Field(None, ge=0)  # as DiskWeightsRequest's

    def tensors(self) -> list[tuple[str, str, list[int]]]:
        if self.names is not None:
            if not (len(self.names) == len(self.dtypes or []) == len(self.shapes or [])):
                raise ValueError("names, dtypes and shapes must have the same length")
            return list(zip(self.names, self.dtypes, self.shapes))
        if self.name is None or self.dtype is None or self.shape is None:
            raise ValueError("give names/dtypes/shapes, or name/dtype/shape")
        return [(self.name, self.dtype, self.shape)]


def stop_reason(output: GenerationOutput, params: SamplingParams, text: str) -> str | int | None:
    """vLLM's `stop_reason`: None for EOS or length, else the stop token id or stop string that ended it."""
    if output.finish_reason != "stop":
        return None
    if output.token_ids and output.token_ids[-1] in params.stop_token_ids:
        return output.token_ids[-1]
    return next((stop for stop in params.stop if stop in text), None)


def logprobs_field(output: GenerationOutput, tokenizer) -> dict[str, Any]:
    """The completions API's `logprobs` object for the sampled tokens."""
    return {"tokens": tokenizer.convert_ids_to_tokens(output.token_ids), "token_logprobs": output.logprobs,
            "top_logprobs": None, "text_offset": None}


def completion_choice(index: int, output: GenerationOutput, params: SamplingParams, tokenizer) -> dict[str, Any]:
    text = tokenizer.decode(output.token_ids, skip_special_tokens=True)
    return {
        "index": index, "text": text, "token_ids": output.token_ids,
        "finish_reason": "length" if output.finish_reason == "length" else "stop",
        "stop_reason": stop_reason(output, params, text),
        "logprobs": logprobs_field(output, tokenizer) if params.return_logprobs else None,
    }


def chat_choice(index: int, output: GenerationOutput, params: SamplingParams, tokenizer) -> dict[str, Any]:
    choice = completion_choice(index, output, params, tokenizer)
    logprobs = None
    if params.return_logprobs:
        tokens = tokenizer.convert_ids_to_tokens(output.token_ids)
        logprobs = {"content": [{"token": token, "logprob": logprob, "top_logprobs": []}
                                for token, logprob in zip(tokens, output.logprobs)]}
    return {"index": index, "message": {"role": "assistant", "content": choice["text"]},
            "token_ids": output.token_ids, "finish_reason": choice["finish_reason"],
            "stop_reason": choice["stop_reason"], "logprobs": logprobs}


def usage(prompts: list[list[int]], outputs: list[GenerationOutput]) -> dict[str, int]:
    """Token counts of a request: every prompt once (a prompt sampled n times counts once)."""
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    completion_tokens = sum(len(output.token_ids) for output in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
