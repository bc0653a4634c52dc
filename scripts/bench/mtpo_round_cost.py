"""Cost of MTPO's round 2 relative to round 1 in the HF engine, with and without prompt-prefill reuse.

Generates the shapes of one demo step (conf/variant/mtpo.yaml: 16 prompts, G = 2 answers, H = 4
confidences) with the embedded tiny model's size and random weights, so every sequence runs to its
length cap (no stop string fires): round 1 continues 16 x G prompts of PROMPT_LEN tokens for
max_answer_length tokens; round 2 continues 16 x G x H prompts (each prompt + answer repeated H
times) for max_confidence_length tokens. Prints seconds per round (best of `--repeats`).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/mtpo_round_cost.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

PROMPTS, G, H = 16, 2, 4  # the demo step
PROMPT_LEN, ANSWER_LEN, CONFIDENCE_LEN = 138, 64, 56  # mtpo_short_qa prompt tokens; mtpo.max_*_length


def best_time(engine: HFGenerationEngine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig()).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early, every round runs to its cap
    tokenizer.eos_token = None
    gen = torch.Generator().manual_seed(0)
    draws = [torch.randint(10, 90, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    round1 = [draw for draw in draws for _ in range(G)]
    answers = [torch.randint(10, 90, (ANSWER_LEN,), generator=gen).tolist() for _ in round1]
    round2 = [prompt + answer for prompt, answer in zip(round1, answers) for _ in range(H)]
    print(f"round 1: {len(round1)} sequences x {ANSWER_LEN} new tokens after {PROMPT_LEN}; "
          f"round 2: {len(round2)} x {CONFIDENCE_LEN} after {PROMPT_LEN + ANSWER_LEN}; {args.threads} thread(s)")
    for reuse in (False, True):
        engine = HFGenerationEngine(model, tokenizer, HFEngineConfig(reuse_prompt_prefill=reuse))
        first = best_time(engine, round1, ANSWER_LEN, args.repeats)
        second = best_time(engine, round2, CONFIDENCE_LEN, args.repeats)
        print(f"reuse_prompt_prefill={reuse}: round 1 {first:.2f} s, round 2 {second:.2f} s, "
              f"round 2 / round 1 = {second / first:.2f}")


if __name__ == "__main__":
    main()
