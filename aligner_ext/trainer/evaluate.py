"""Held-out evaluation: greedy responses to the validation prompts, scored by the reward registry."""

from __future__ import annotations

import math

import torch

from aligner_ext.data.loader import PromptLoader
from aligner_ext.generation.base import GenerationEngine, SamplingParams
from aligner_ext.rewards.manager import RewardManager


def evaluate(engine: GenerationEngine, rewards: RewardManager, tokenizer, loader: PromptLoader,
             max_new_tokens: int, stop: list[str]) -> dict[str, float]:
    """Greedy accuracy, mean reward and mean response length over one pass of `loader`; with more than
    one data_source in it, also `val/<data_source>/accuracy` and `val/<data_source>/reward_mean`.
    Accuracy averages the responses whose reward reports correctness (NaN where none does)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=list(stop))
    sources, scores, correct, lengths = [], [], [], []
    for draws in loader.iterate_once():
        outputs = engine.generate([draw.prompt_ids for draw in draws], params)
        texts = [tokenizer.decode(output.token_ids, skip_special_tokens=True) for output in outputs]
        for result, output, draw in zip(rewards.score(texts, [draw.row for draw in draws]), outputs, draws):
            sources.append(draw.row.data_source)
            scores.append(result.score)
            correct.append(math.nan if result.correct is None else result.correct)
            lengths.append(len(output.token_ids))
    metrics = {
        "val/accuracy": float(torch.tensor(correct).nanmean()),
        "val/reward_mean": float(torch.tensor(scores).mean()),
        "val/response_length": float(torch.tensor(lengths, dtype=torch.float32).mean()),
        "val/num_prompts": float(len(scores)),
    }
    names = sorted(set(sources))
    if len(names) > 1:
        source_of = torch.tensor([names.index(source) for source in sources])
        correct_t, scores_t = torch.tensor(correct, dtype=torch.float64), torch.tensor(scores, dtype=torch.float64)
        for index, name in enumerate(names):
            mine = source_of == index
            metrics[f"val/{name}/accuracy"] = float(correct_t[mine].nanmean())
            metrics[f"val/{name}/reward_mean"] = float(scores_t[mine].mean())
    return metrics
