"""How much of float32 training's update bf16 training keeps: float32 master weights (the HF backend's
default, models/master_weights.py) against AdamW with stochastic rounding on the bf16 weights
(torchao's `_AdamW(bf16_stochastic_round=True)`, 8 bytes a parameter as plain bf16 AdamW). On the CPU,
the tests' tiny model, lr 1e-6, the same batch each step (docs/benchmarks.md, "Float32 master weights").

    pip install --target /tmp/torchao --no-deps torchao==0.18.0
    PYTHONPATH=/tmp/torchao:tests/unit/models .venv/bin/python scripts/bench/bf16_updates.py
"""

from __future__ import annotations

import copy

import torch
from torchao.optim import _AdamW

from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import HFPolicy
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from test_hf_policy import ragged_batch

LR = 1e-6


def moved(model, vocab: int, dtype: str, stochastic_rounding: bool, steps: int) -> torch.Tensor:
    """The weights' change (the masters' where there are masters) after `steps` updates, flattened."""
    cfg = PolicyConfig(device="cpu", dtype=dtype, micro_batch_size=2,
                       optim=OptimConfig(lr=LR, master_weights=not stochastic_rounding))
    policy = HFPolicy(copy.deepcopy(model), cfg, total_steps=steps)
    if stochastic_rounding:
        policy.optimizer = _AdamW(policy.trainable, lr=LR, weight_decay=0.0, bf16_stochastic_round=True)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)
    for _ in range(steps):
        batch = ragged_batch(vocab)
        batch.advantages = torch.linspace(-1, 1, batch.response_ids.numel()).view_as(batch.response_ids)
        policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    after = torch.cat([weight.detach().float().flatten() for weight in policy.trainable])
    return after - torch.cat([weight.detach().flatten() for weight in model.parameters()])


def main() -> None:
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                                        intermediate_size=64, seed=0))
    model.to(torch.bfloat16).to(torch.float32)  # weights bf16 holds exactly: every run starts equal
    for steps in (1, 10):
        reference = moved(model, len(tokenizer), "float32", False, steps)
        moves = reference != 0
        for name, stochastic in (("float32 masters", False), ("stochastic rounding", True)):
            change = moved(model, len(tokenizer), "bfloat16", stochastic, steps)
            error = (change - reference)[moves].abs().mean() / reference[moves].abs().mean()
            print(f"{steps:>2} update(s), {name:>19}: moves {float((change[moves] != 0).float().mean()):.3f} of the "
                  f"elements float32 moves; mean |difference| / mean |float32 change| {float(error):.3f}")


if __name__ == "__main__":
    main()
