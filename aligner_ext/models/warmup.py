"""Supervised warm-up of the embedded tiny model on a built-in task's gold responses.

A randomly initialised model never samples a correct answer, so GRPO would have no signal. A short
supervised phase brings it to partial accuracy; it stops early on purpose, to leave RL room to
improve the model.

An example is `(messages, target)` or `(messages, target, tools)` (the experience maker's
`warmup_examples` makes them): `target` is the assistant turn to learn, either its content (a string,
followed by the end token) or a whole assistant message (a dict, e.g. with `tool_calls`), which the
chat template renders as the model is to write it, through its end token; `tools` are the schemas the
prompt is rendered with, as an agent episode renders it.
"""

from __future__ import annotations

import logging
import random

import torch
from tqdm import tqdm

from aligner_ext.data.templating import encode_prompt
from aligner_ext.models.settings import WarmupConfig

logger = logging.getLogger(__name__)




def uses_bfloat16(device: torch.device, setting: str) -> bool:
    """Whether the warm-up runs under bfloat16 autocast. On a GPU the matrix products then run on the
    bfloat16 tensor cores and the saved activations take half the memory, which a larger embedded
    model needs (a float32 warm-up of 358M parameters held ~50 GB); weights and optimizer stay
    float32. The CPU default keeps the float32 warm-up the demo was tuned with."""
    return setting == "bfloat16" or (setting == "auto" and device.type == "cuda")


def supervised_warmup(model, tokenizer, pairs: list[tuple], cfg: WarmupConfig, progress: bool = True,
                      drills: list[tuple] = ()) -> float:
    """Train `model` on (chat messages, target[, tools]) examples (module docstring), loss only on the
    target's tokens: `cfg.drill_steps` steps on `drills` (the task's, data/tasks/base.py), then
    `cfg.steps` on `pairs`, with one optimizer. Returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    order = random.Random(cfg.seed)
    loss_value = float("nan")
    for stage, examples, steps in (("drills", drills, cfg.drill_steps), ("warm-up", pairs, cfg.steps)):
        if steps:
            loss_value = _train(model, tokenizer, _encoded(tokenizer, examples), steps, cfg, optimizer, order,
                                stage, progress)
    return loss_value


def _encoded(tokenizer, pairs: list[tuple]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of each example."""
    examples = []
    for messages, target, *tools in pairs:
        prompt = encode_prompt(tokenizer, messages, *tools)
        if isinstance(target, str):
            answer = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        else:
            answer = rendered_turn(tokenizer, messages, target, *tools)
        examples.append((prompt, answer))
    return examples


def _train(model, tokenizer, examples: list[tuple[list[int], list[int]]], steps: int, cfg: WarmupConfig,
           optimizer, order: random.Random, stage: str, progress: bool) -> float:
    """`steps` optimizer steps on batches sampled from `examples`; returns the last loss."""
    bf16 = uses_bfloat16(model.device, cfg.autocast)
    model.train()
    loss_value = float("nan")
    for _ in tqdm(range(steps), desc=stage, disable=not progress):
        batch = order.sample(examples, k=min(cfg.batch_size, len(examples)))
        input_ids, labels, attention = _right_padded(batch, tokenizer.pad_token_id)
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
                         labels=labels.to(model.device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
    logger.info("%s: %d steps, final loss %.4f", stage, steps, loss_value)
    return loss_value


def rendered_turn(tokenizer, messages: list[dict], turn: dict, tools: list[dict] | None = None) -> list[int]:
    """The ids of assistant message `turn` as the chat template writes it after `messages` and the
    generation prompt, through its end token (what the template adds after that is not the model's)."""
    before = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    after = tokenizer.apply_chat_template([*messages, turn], tools=tools, add_generation_prompt=False, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template renders the conversation differently once the warm-up's target turn "
                         "is added: its generation prompt does not start the turn")
    text = after[len(before):]
    end = text.rfind(tokenizer.eos_token)
    if end < 0:
        raise ValueError(f"the chat template writes no end token ({tokenizer.eos_token}) after an assistant turn")
    return list(tokenizer(text[: end + len(tokenizer.eos_token)], add_special_tokens=False)["input_ids"])


def _right_padded(batch: list[tuple[list[int], list[int]]], pad_id: int):
    width = max(len(p) + len(a) for p, a in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(batch):
        sequence = prompt + answer
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        labels[i, len(prompt) : len(sequence)] = torch.tensor(answer)
        attention[i, : len(sequence)] = 1
    return input_ids, labels, attention
