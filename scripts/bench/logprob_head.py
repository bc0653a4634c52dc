"""The log-prob head alone on a GPU: the fused head (`models/logprobs.py`) against the previous one.

The previous head, kept here as the baseline: logits of `chunk` tokens in the hidden dtype, upcast to
float32, divided by the temperature, log_softmax and gather, each chunk under non-reentrant
activation checkpointing (the backward recomputes it), the chunks' weight gradients summed by
autograd. Both run forward + backward of sum(log-probs * g) on N tokens of a Qwen2.5-1.5B-shape head
(hidden 1536, vocabulary 151,936, bf16, temperature 0.9), at the chunk sizes each backend used or
uses: the old Megatron packed path 128 tokens, the old HF path 64 rows x 128 positions = 8192; the
fused head its default 4096. Prints one JSON line per setting: ms per call (median of 10 after 3),
peak memory above the inputs, and the errors against a float64 computation on the same inputs.

    python scripts/bench/logprob_head.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from aligner_ext.models.logprobs import fused_logprobs


def previous_head(hidden, weight, targets, chunk, temperature):
    def chunk_fn(h, w, t):
        logp = torch.log_softmax((h @ w.T).float() / temperature, dim=-1)
        return logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)

    parts = [checkpoint(chunk_fn, hidden[i : i + chunk], weight, targets[i : i + chunk], use_reentrant=False)
             for i in range(0, hidden.shape[0], chunk)]
    return torch.cat(parts)


def run(name, head, hidden, weight, targets, probe, exact):
    def call():
        hidden.grad = weight.grad = None
        lp = head()
        (lp * probe).sum().backward()
        return lp

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        lp = call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base
    exact_lp, exact_grad_h, exact_grad_w = exact
    return {"head": name, "ms": 1000 * statistics.median(times), "peak_extra_gib": peak / 2**30,
            "logprob_err_max": float((lp.double() - exact_lp).abs().max()),
            "grad_hidden_rel_err": float((hidden.grad.double() - exact_grad_h).norm() / exact_grad_h.norm()),
            "grad_weight_rel_err": float((weight.grad.double() - exact_grad_w).norm() / exact_grad_w.norm())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.9)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    hidden = (torch.randn(args.tokens, args.hidden, device=device) * 2).bfloat16().requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(args.vocab, (args.tokens,), device=device)
    probe = torch.randn(args.tokens, device=device)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact_lp = torch.log_softmax(h64 @ w64.T / args.temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
    exact = (exact_lp.detach(), *torch.autograd.grad((exact_lp * probe.double()).sum(), (h64, w64)))
    del h64, w64, exact_lp
    torch.cuda.empty_cache()
    settings = [
        ("previous, chunk 128 (Megatron packed)", lambda: previous_head(hidden, weight, targets, 128, args.temperature)),
        ("previous, chunk 8192 (HF rows)", lambda: previous_head(hidden, weight, targets, 8192, args.temperature)),
        ("fused, chunk 4096", lambda: fused_logprobs(hidden, weight, targets, 4096, False, args.temperature)[0]),
        ("fused, chunk 8192", lambda: fused_logprobs(hidden, weight, targets, 8192, False, args.temperature)[0]),
    ]
    for name, head in settings:
        result = run(name, head, hidden, weight, targets, probe, exact)
        result.update(tokens=args.tokens, gpu=torch.cuda.get_device_name())
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
