"""Generation speed: the HF engine against megatron-core's legacy static inference engine, same weights.

The Megatron backend generates with `HFGenerationEngine` on its in-memory HF copy of the policy
(docs/megatron.md). This script measures whether megatron-core's own engine on the GPTModel would be
faster. One process, TP=1 (`python` or `torchrun --nproc_per_node=1`); Qwen2.5-0.5B's shape with random
weights (`megatron_bench.qwen2_half_billion`), or a tiny Qwen2 on CPU with `--tiny`.

Engines (each samples the same weights, converted HF -> Megatron by `convert.hf_to_megatron_shard`):
  hf           `aligner_ext.generation.hf.HFGenerationEngine` on the transformers model;
  mcore_local  megatron-core 0.16's `StaticInferenceEngine(legacy=True)` (the default engine builds the
               dynamic one, whose attention asserts flash-attn) on a GPTModel whose core attention is
               megatron's own `DotProductAttention` (baddbmm + softmax; the local layer spec);
  mcore_sdpa   the same engine on a GPTModel with `DecodeSDPAttention` below (torch SDPA, which the
               training model uses; its `SDPAttention` is causal by construction, wrong for decode).

Steps:
  1. same function: greedy decoding in float32 of `--check-prompts` prompts for `--check-tokens`
     tokens; PASS when each megatron engine's tokens equal HF's for at least 90% of the prompts
     (float32 leaves no near-ties to flip) and the log-probs of the tokens both chose agree within
     1e-3 (a random model often repeats one token greedily, which a decode step attending to the
     wrong keys would still reproduce; its log-probs would move);
  2. speed in the run dtype (bf16 on GPU, float32 on CPU): `--batch` prompts of exactly `--prompt`
     random tokens, `--response` new tokens each at temperature 1 (the loop's sampling), no EOS, so
     every sequence generates the full length (the generated tokens are counted and checked); one
     warm-up call, then `--repeats` timed calls; a 1-token call gives the prefill time; plus the
     greedy agreement in this dtype (INFO: bf16 rounding flips near-ties of a random model).

Decisions:
  - All prompts have the same length: the legacy static engine right-pads and feeds the tokens of
    longer prompts one decode step at a time, so variable lengths would charge it for a per-token
    prefill that the HF engine (left padding) does not pay; equal lengths time the same work.
  - The GPTModel's vocabulary is padded to a multiple of 128 with zero rows (logit 0); megatron-core
    samples over the padded vocabulary, so a forward hook sets those logits to -inf, as the
    training path masks them (`logprobs.py`). An engine wired into the loop must do the same.
  - The megatron models use `attention_backend=local`, so the inference wrapper passes an explicit
    causal mask (megatron's implicit one is built on `device="cuda"`, which fails on CPU).

Prints PASS / FAIL / INFO / RESULT lines and one JSON line; writes $OUT/generation_engines.json when
OUT is set. Exit status 1 when a check fails. On the GPU machine: scripts/bench/generation_engines_gpu.sh;
on CPU: `python scripts/bench/generation_engines.py --tiny`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback

os.environ.setdefault("TQDM_DISABLE", "1")  # megatron-core's engine opens a progress bar per call

import torch
import torch.nn.functional as F
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.engines import StaticInferenceEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.sampling_params import SamplingParams as McoreSamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from transformers import AutoModelForCausalLM, Qwen2Config

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.models.megatron import convert
from aligner_ext.models.megatron.model import SDPAttention, block_spec, padded_vocab_size, transformer_config
from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel
from megatron_bench import qwen2_half_billion  # this script's directory: scripts/bench


class DecodeSDPAttention(SDPAttention):
    """`SDPAttention` that also serves KV-cached decode steps.

    megatron-core's static loop runs one prefill from column 0 (as many queries as keys: causal), then
    one query per step over all cached keys (nothing to mask). The wrapper's explicit causal mask is
    not read: causality comes from the query and key lengths.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if query.shape[0] == key.shape[0]:
            return super().forward(query, key, value, None, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)
        if query.shape[0] != 1:
            raise ValueError(f"decode takes one query per step, got {query.shape[0]} over {key.shape[0]} keys")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(1, query.shape[1], -1)


MCORE_ATTENTION = {"mcore_local": DotProductAttention, "mcore_sdpa": DecodeSDPAttention}


class IdTokenizer:
    """Token ids written as decimal words: all either engine needs, with no EOS (full-length runs)."""

    eos_token_id = None  # HF engine: no EOS, sequences end at max_new_tokens
    pad_token_id = 0
    bos = None
    eod = 0  # megatron-core pads prompts with it; its early termination is switched off

    def tokenize(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    decode = detokenize


class _HostEvent:
    """Stand-in for torch.cuda.Event on a CPU-only run: the static loop records one per step."""

    def __init__(self, enable_timing: bool = False):
        self.time = 0.0

    def record(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.time - self.time) * 1e3


def tiny_config() -> Qwen2Config:
    """A Qwen2 small enough for two CPU cores; vocabulary 1000 is padded to 1024 (exercises the mask)."""
    return Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=True)


def mask_padded_vocab(vocab_size: int):
    """Forward hook on the output layer: logits of the padding rows become -inf."""

    def hook(module, args, output):
        logits, bias = output
        logits[..., vocab_size:] = float("-inf")
        return logits, bias

    return hook


def mcore_model(hf_model, core_attention) -> GPTModel:
    """A TP=1 GPTModel holding `hf_model`'s weights, with the given core attention."""
    hf_config, parameter = hf_model.config, next(hf_model.parameters())
    config = transformer_config(hf_config, 1, 1, parameter.dtype)
    config.attention_backend = AttnBackend.local
    spec = block_spec(config)
    spec.layer_specs[0].submodules.self_attention.submodules.core_attention = core_attention  # shared by all layers
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab_size(hf_config.vocab_size, 1),
                     max_sequence_length=hf_config.max_position_embeddings, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
                     position_embedding_type="rope", rotary_base=hf_config.rope_parameters["rope_theta"])
    model = model.to(device=parameter.device, dtype=parameter.dtype)
    convert.load_shard(model, convert.hf_to_megatron_shard(hf_model.state_dict(), hf_config, 1, 1, 0, 0))
    model.output_layer.register_forward_hook(mask_padded_vocab(hf_config.vocab_size))
    return model.eval()


def mcore_generate_fn(model: GPTModel, tokenizer, max_batch: int, max_length: int):
    """generate(prompts, greedy, new_tokens, logprobs) -> (ids, log-probs or None) per prompt, on
    megatron-core's legacy static engine."""
    wrapper_config = InferenceWrapperConfig(
        hidden_size=model.config.hidden_size, params_dtype=model.config.params_dtype,
        inference_batch_times_seqlen_threshold=-1, padded_vocab_size=model.vocab_size,
        inference_max_requests=max_batch, inference_max_seq_length=max_length,
    )
    wrapped = GPTInferenceWrapper(model, wrapper_config, StaticInferenceContext.from_config(wrapper_config))
    engine = StaticInferenceEngine(TextGenerationController(wrapped, tokenizer), max_batch_size=max_batch, legacy=True)

    def generate(prompts: list[list[int]], greedy: bool, new_tokens: int, logprobs: bool = False):
        params = McoreSamplingParams(temperature=1.0, top_k=1 if greedy else 0, top_p=0.0,
                                     num_tokens_to_generate=new_tokens, return_log_probs=logprobs)
        params.add_attributes({"no_early_termination": True})
        requests = engine.generate(prompts=[tokenizer.detokenize(p) for p in prompts], sampling_params=params)
        return ([request.generated_tokens.tolist() for request in requests],
                [request.generated_log_probs for request in requests] if logprobs else None)

    return generate


def hf_generate_fn(hf_model, tokenizer, max_batch: int, seed: int):
    """generate(prompts, greedy, new_tokens, logprobs) -> (ids, log-probs or None) per prompt, HF engine."""
    hf_model.generation_config.eos_token_id = None  # no EOS: every sequence runs to max_new_tokens
    engine = HFGenerationEngine(hf_model, tokenizer, HFEngineConfig(batch_size=max_batch))

    def generate(prompts: list[list[int]], greedy: bool, new_tokens: int, logprobs: bool = False):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0 if greedy else 1.0,
                                return_logprobs=logprobs, seed=seed)
        outputs = engine.generate(prompts, params)
        return [output.token_ids for output in outputs], [output.logprobs for output in outputs] if logprobs else None

    return generate


def build_engines(hf_model, names: list[str], args) -> dict:
    """name -> generate function; the megatron models are built from `hf_model`'s weights. An engine
    whose construction raises gets a function raising that error, reported like a failed call."""
    tokenizer, max_length = IdTokenizer(), args.prompt + args.response
    engines = {"hf": hf_generate_fn(hf_model, tokenizer, args.batch, args.seed)}
    for name in names:
        try:
            model = mcore_model(hf_model, MCORE_ATTENTION[name])
            engines[name] = mcore_generate_fn(model, tokenizer, args.batch, max_length)
        except Exception as error:
            engines[name] = _raising(error)
    return engines


def _raising(error: Exception):
    def generate(*args, **kwargs):
        raise RuntimeError(f"building the engine failed: {type(error).__name__}: {error}") from error

    return generate


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def agreement(ours: tuple, reference: tuple) -> dict:
    """How far each prompt's greedy tokens follow the reference's, and how close the log-probs of the
    tokens both chose are (positions before the first difference): a decode step that attends to the
    wrong keys changes the log-probs even where a random model's argmax does not move."""
    (tokens, logprobs), (ref_tokens, ref_logprobs) = ours, reference
    prefixes, diffs = [], [0.0]
    for row, (mine, theirs) in enumerate(zip(tokens, ref_tokens)):
        common = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        prefixes.append(common)
        diffs.extend(abs(a - b) for a, b in zip(logprobs[row][:common], ref_logprobs[row][:common]))
    full = [p == len(r) == len(t) for p, t, r in zip(prefixes, tokens, ref_tokens)]
    return {"all_equal": sum(full) / len(full), "first_equal": sum(p > 0 for p in prefixes) / len(prefixes),
            "mean_common_prefix": sum(prefixes) / len(prefixes), "max_logprob_diff": max(diffs),
            "tokens": len(ref_tokens[0])}


def check_greedy(engines: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy tokens and log-probs of every engine against HF's; an engine that raises is reported."""
    outputs = {}
    for name, generate in engines.items():
        try:
            outputs[name] = generate(prompts, True, new_tokens, logprobs=True)
        except Exception as error:  # recorded, so the other engines still run
            outputs[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if isinstance(outputs["hf"], dict):
        return {name: outputs["hf"] for name in engines if name != "hf"}
    return {name: out if isinstance(out, dict) else agreement(out, outputs["hf"])
            for name, out in outputs.items() if name != "hf"}


def measure(generate, prompts: list[list[int]], new_tokens: int, repeats: int, vocab_size: int) -> dict:
    """Sampled generation at temperature 1: warm-up, prefill time (1 token), `repeats` timed calls."""
    try:
        generate(prompts, False, new_tokens)  # full length: the timed calls find the memory already grown
        _, prefill_s = timed(lambda: generate(prompts, False, 1))
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        seconds, counts, outside = [], set(), 0
        for _ in range(repeats):
            (tokens, _), elapsed = timed(lambda: generate(prompts, False, new_tokens))
            seconds.append(elapsed)
            counts.update(len(t) for t in tokens)
            outside += sum(token >= vocab_size or token < 0 for t in tokens for token in t)
    except Exception as error:  # recorded, so the other engines still run
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    mean = sum(seconds) / len(seconds)
    total = len(prompts) * new_tokens
    return {
        "seconds": seconds, "tokens_per_call": total, "tokens_per_s": total / mean, "prefill_s": prefill_s,
        "decode_tokens_per_s": len(prompts) * (new_tokens - 1) / max(mean - prefill_s, 1e-9),
        "lengths_seen": sorted(counts), "ids_outside_vocab": outside,
        "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if torch.cuda.is_available() else None,
    }


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args, device: torch.device) -> tuple[dict, list[tuple[bool, str]]]:
    config = tiny_config() if args.tiny else qwen2_half_billion()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, config.vocab_size, (args.batch, args.prompt), generator=generator).tolist()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    result = {"settings": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "hf_attention": hf_model.config._attn_implementation}
    checks: list[tuple[bool, str]] = []

    engines = build_engines(hf_model, args.engines, args)
    result["greedy_fp32"] = check_greedy(engines, prompts[: args.check_prompts], args.check_tokens)
    for name, found in result["greedy_fp32"].items():
        ok = "error" not in found and found["all_equal"] >= 0.9 and found["max_logprob_diff"] < 1e-3
        checks.append((ok, f"float32 greedy {name} vs hf: " + (found["error"] if "error" in found else
                       f"{found['all_equal']:.0%} of {args.check_prompts} prompts equal over {args.check_tokens} "
                       f"tokens (mean common prefix {found['mean_common_prefix']:.1f}), log-probs within "
                       f"{found['max_logprob_diff']:.1e} (need 90% and 1e-3)")))
    del engines
    release_memory()

    hf_model = hf_model.to(dtype)
    engines = build_engines(hf_model, args.engines, args)
    if dtype != torch.float32:
        result["greedy_run_dtype"] = check_greedy(engines, prompts[: args.check_prompts], args.check_tokens)
    result["speed"] = {}
    for name, generate in engines.items():
        found = measure(generate, prompts, args.response, args.repeats, config.vocab_size)
        result["speed"][name] = found
        if "error" in found:
            checks.append((False, f"{name} sampling raised {found['error']}"))
            continue
        checks.append((found["lengths_seen"] == [args.response] and found["ids_outside_vocab"] == 0,
                       f"{name} generated {found['lengths_seen']} tokens per sequence (expected {args.response}), "
                       f"{found['ids_outside_vocab']} ids outside the vocabulary"))
    del engines, hf_model
    release_memory()
    return result, checks


def report(result: dict, checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {message}", flush=True)
    for name, found in result.get("greedy_run_dtype", {}).items():
        print(f"INFO: {result['dtype']} greedy {name} vs hf: " + (found["error"] if "error" in found else
              f"first token equal for {found['first_equal']:.0%}, all {found['tokens']} for {found['all_equal']:.0%}, "
              f"mean common prefix {found['mean_common_prefix']:.1f}, log-probs within "
              f"{found['max_logprob_diff']:.1e}"), flush=True)
    speeds = {name: found for name, found in result["speed"].items() if "error" not in found}
    for name, found in speeds.items():
        print(f"INFO: {name}: {found['tokens_per_s']:.0f} tok/s ({found['tokens_per_call']} tokens in "
              f"{min(found['seconds']):.2f}-{max(found['seconds']):.2f} s; prefill {found['prefill_s']:.2f} s; "
              f"decode {found['decode_tokens_per_s']:.0f} tok/s)", flush=True)
    if speeds:
        fastest = max(speeds, key=lambda name: speeds[name]["tokens_per_s"])
        result["fastest"] = fastest
        print(f"RESULT: fastest on {result['device']} ({result['dtype']}): {fastest}, " + ", ".join(
            f"{name} {found['tokens_per_s']:.0f} tok/s" for name, found in speeds.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2 and workload (CPU check)")
    parser.add_argument("--batch", type=int, help="prompts per call (default 128; 4 with --tiny)")
    parser.add_argument("--prompt", type=int, help="tokens per prompt (default 128; 8 with --tiny)")
    parser.add_argument("--response", type=int, help="new tokens per prompt (default 256; 8 with --tiny)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per engine")
    parser.add_argument("--check-prompts", type=int, default=16, help="prompts in the greedy agreement check")
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--engines", nargs="+", default=sorted(MCORE_ATTENTION), choices=sorted(MCORE_ATTENTION),
                        help="megatron-core engines to run besides hf")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    small = args.tiny
    args.batch = args.batch or (4 if small else 128)
    args.prompt = args.prompt or (8 if small else 128)
    args.response = args.response or (8 if small else 256)
    args.check_prompts = min(args.check_prompts, args.batch)
    args.check_tokens = min(args.check_tokens, args.response)

    device = init_distributed()  # CPU: applies the CPU shims
    if dist.get_world_size() != 1:
        raise SystemExit("generation_engines.py runs as one process (TP=1)")
    init_model_parallel(1, 1)
    if device.type == "cpu":
        torch.cuda.Event = _HostEvent
    result, checks = run(args, device)
    report(result, checks)
    result["checks"] = [{"ok": ok, "message": message} for ok, message in checks]
    print(json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "generation_engines.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    dist.destroy_process_group()
    if not all(ok for ok, _ in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
