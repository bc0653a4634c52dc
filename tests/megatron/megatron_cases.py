"""Tiny HF models of each supported architecture, a left/right-padded batch, and the torchrun launch,
shared by the Megatron tests. Norm weights and biases are perturbed away from their 1/0
initialisation so a mis-mapped norm or bias changes the results."""

import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64)


def hf_configs() -> dict:
    """Llama with tied embeddings; Qwen2 (q/k/v biases); Qwen3 (q/k norms, head_dim 16 != 32/4).
    Vocabulary sizes 104, 100, 200 are not multiples of 128, so every case exercises vocab padding."""
    return {
        "llama": LlamaConfig(vocab_size=104, tie_word_embeddings=True, **COMMON),
        "qwen2": Qwen2Config(vocab_size=100, tie_word_embeddings=False, **COMMON),
        "qwen3": Qwen3Config(vocab_size=200, head_dim=16, tie_word_embeddings=False, **COMMON),
    }


def build_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def batch_tensors(vocab_size: int) -> dict:
    """3 rows: prompts of 3, 5, 2 tokens left-padded to 5; responses of 4, 1, 3 tokens right-padded to 4."""
    generator = torch.Generator().manual_seed(1)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    response_valid = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    prompt_ids = torch.randint(1, vocab_size, (3, 5), generator=generator) * prompt_mask
    response_ids = torch.randint(1, vocab_size, (3, 4), generator=generator) * response_valid
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_valid=response_valid)


def torchrun(args: list[str], processes: int = 2, timeout: int = 300, pythonpath: tuple[str, ...] = ()) -> None:
    """`python -m torch.distributed.run --nproc_per_node=<processes> <args>` on a free port, one OpenMP
    thread per process; fails the test with the end of its output if it exits non-zero."""
    from aligner_ext.models.megatron.parallel import free_port  # imports megatron-core: tests skip without it

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               f"--master_port={free_port()}", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
