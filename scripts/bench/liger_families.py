"""Liger-Kernel's patches against transformers' modules on every family of `models/kernels.py::LIGER_PATCHES`
(one GPU, bf16, a small random-weight model per family): the token log-probs of the patched model and
of the unpatched one, each against a float32 forward of the same weights. The patch is right where its
error is of the size of bf16's own (a wrong rotary, norm offset or casting shows as errors of order 1).

    python scripts/bench/liger_families.py   # on the GPU machine (gpu_env.sh first); prints a table
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from aligner_ext.models.family_configs import LAYOUTS, family_config
from aligner_ext.models.kernels import LIGER_PATCHES, patch_with_liger

SIZES = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1536, max_position_embeddings=1024, vocab_size=32000, sliding_window=64)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def main() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, SIZES["vocab_size"], (4, 256), device="cuda")
    print("| family | unpatched bf16 vs float32 (max abs) | Liger bf16 vs float32 (max abs) |")
    print("| --- | --- | --- |")
    for name in LAYOUTS:
        config = family_config(name, **SIZES)
        if config.model_type not in LIGER_PATCHES:
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).cuda().eval()
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "norm" in parameter_name:
                    parameter.add_(torch.randn_like(parameter) * 0.1)
            reference = token_logprobs(model, ids)
            plain = copy.deepcopy(model).to(torch.bfloat16)
            plain_error = (token_logprobs(plain, ids) - reference).abs().max().item()
            patched = copy.deepcopy(model).to(torch.bfloat16)
            patch_with_liger(patched)
            liger_error = (token_logprobs(patched, ids) - reference).abs().max().item()
        print(f"| {name} | {plain_error:.4f} | {liger_error:.4f} |", flush=True)
        del model, plain, patched


if __name__ == "__main__":
    main()
