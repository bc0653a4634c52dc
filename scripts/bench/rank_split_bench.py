"""What splitting generation across ranks costs and saves: one HF-engine call over all requests on
each rank (the loop without the split) against `RankSplitEngine` (each rank generates its share,
then the outputs are all-gathered), and the all-gather alone.

Run with `torchrun --nproc_per_node=2 scripts/bench/rank_split_bench.py` (GPUs: NCCL; CPU: gloo).
Two models: the demo's embedded tiny model (128 requests x 24 tokens, as conf/demo.yaml) and a
randomly initialised model of Qwen2.5-0.5B's shape (256 x 128 tokens, GPUs only); no EOS, so every call
generates the full length. Rank 0 prints the median of `--repeats` calls of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from aligner_ext.distributed import init_from_env, map_split
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.sharded import RankSplitEngine
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model


class NoEosTokenizer:
    """What the engine reads from a tokenizer, with no EOS: every sequence runs to max_new_tokens."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def models(device, dtype):
    tiny = build_tiny_model(build_char_tokenizer(), TinyModelConfig())
    tiny.generation_config.eos_token_id = None
    yield "tiny (demo)", tiny.to(device, dtype), 128, 24
    if device.type == "cpu":
        return  # the 0.5B model takes minutes per call on a CPU
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    yield "Qwen2.5-0.5B shape", AutoModelForCausalLM.from_config(config).to(device, dtype), 256, 128


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    init_from_env()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    for name, model, requests, tokens in models(device, dtype):
        engine = HFGenerationEngine(model, NoEosTokenizer(), HFEngineConfig())
        prompts = [[5, 6, 7, 8, 9, 10][: 3 + i % 4] for i in range(requests)]
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=0, return_logprobs=True)
        outputs = engine.generate(prompts, params)
        repeated = median_seconds(lambda: engine.generate(prompts, params), args.repeats)
        split = median_seconds(lambda: RankSplitEngine(engine).generate(prompts, params), args.repeats)
        gather = median_seconds(lambda: map_split(lambda share: outputs[: len(share)], prompts), args.repeats)
        if dist.get_rank() == 0:
            print(f"{name}: {requests} requests x {tokens} tokens on {dist.get_world_size()} ranks: every rank all "
                  f"{repeated:.3f} s, split {split:.3f} s, of which the all-gather alone {gather:.4f} s", flush=True)


if __name__ == "__main__":
    main()
