"""Held-out evaluation: greedy responses to the validation prompts, scored by the reward registry."""

from __future__ import annotations

import math

import torch

from aligner_ext.data.loader import PromptLoader
from aligner_ext.generation.base import GenerationEngine, SamplingParams
from aligner_ext.rewards.manager import RewardManager


def evaluate(engine: GenerationEngine, rewards: RewardManager, tokenizer, loader: PromptLoader,
             max_new_tokens: int, stop: list[str]) -> dict[str, float]:
    """Greedy accuracy, mean reward and mean response length over one pass of `loader`."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=list(stop))
    scores, correct, lengths = [], [], []
    for draws in loader.iterate_once():
        outputs = engine.generate([draw.prompt_ids for draw in draws], params)
        texts = [tokenizer.decode(output.token_ids, skip_special_tokens=True) for output in outputs]
        for result, output in zip(rewards.score(texts, [draw.row for draw in draws]), outputs):
            scores.append(result.score)
            correct.append(math.nan if result.correct is None else result.correct)
            lengths.append(len(output.token_ids))
    return {
        "val/accuracy": float(torch.tensor(correct).nanmean()),
        "val/reward_mean": float(torch.tensor(scores).mean()),
        "val/response_length": float(torch.tensor(lengths, dtype=torch.float32).mean()),
        "val/num_prompts": float(len(scores)),
    }
