"""The log-prob head alone on a GPU: the fused head (`models/logprobs.py`) against the previous one.

The previous head, kept here as the baseline: logits of `chunk` tokens in the hidden dtype, upcast to
float32, divided by the temperature, log_softmax and gather, each chunk under non-reentrant
activation checkpointing (the backward recomputes it), the chunks' weight gradients summed by
autograd. Both run forward + backward of sum(log-probs * g) on N tokens of a Qwen2.5-1.5B-shape head
(hidden 1536, vocabulary 151,936, bf16, temperature 0.9), at the chunk sizes each backend used or
uses: the old Megatron packed path 128 tokens, the old HF path 64 rows x 128 positions = 8192; the
fused head its default 4096. Per setting: ms per call (median of 10 after 3), peak memory above the
inputs (GPU), and the errors against a float64 computation on the same inputs; logprob_head.json and
.md under --out.

    python scripts/bench/run.py logprob-head [--tokens 8192]      # one GPU
    python scripts/bench/run.py logprob-head --tiny               # the CPU, float32, small sizes (tests/bench)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

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

    cuda = hidden.is_cuda
    for _ in range(3):
        call()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        lp = call()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    exact_lp, exact_grad_h, exact_grad_w = exact
    return {"head": name, "ms": 1000 * statistics.median(times), "peak_extra_gib": peak / 2**30,
            "logprob_err_max": float((lp.double() - exact_lp).abs().max()),
            "grad_hidden_rel_err": float((hidden.grad.double() - exact_grad_h).norm() / exact_grad_h.norm()),
            "grad_weight_rel_err": float((weight.grad.double() - exact_grad_w).norm() / exact_grad_w.norm())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--tiny", action="store_true", help="the CPU in float32: 300 tokens, hidden 32, vocabulary 500")
    parser.add_argument("--out", type=Path, default=Path("bench_out/logprob_head"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.vocab = 300, 32, 500
    torch.manual_seed(0)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    hidden = (torch.randn(args.tokens, args.hidden, device=device) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(args.vocab, (args.tokens,), device=device)
    probe = torch.randn(args.tokens, device=device)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact_lp = torch.log_softmax(h64 @ w64.T / args.temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
    exact = (exact_lp.detach(), *torch.autograd.grad((exact_lp * probe.double()).sum(), (h64, w64)))
    del h64, w64, exact_lp
    small, large = (64, 128) if args.tiny else (4096, 8192)
    settings = [
        ("previous, chunk 128 (Megatron packed)", lambda: previous_head(hidden, weight, targets, 128, args.temperature)),
        ("previous, chunk 8192 (HF rows)", lambda: previous_head(hidden, weight, targets, 8192, args.temperature)),
        (f"fused, chunk {small}", lambda: fused_logprobs(hidden, weight, targets, small, False, args.temperature)[0]),
        (f"fused, chunk {large}", lambda: fused_logprobs(hidden, weight, targets, large, False, args.temperature)[0]),
    ]
    report = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "heads": []}
    for name, head in settings:
        report["heads"].append(run(name, head, hidden, weight, targets, probe, exact))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logprob_head.json").write_text(json.dumps(report, indent=2))
    lines = [f"Log-prob head, {args.tokens} tokens x hidden {args.hidden} x vocabulary {args.vocab} ({report['device']}):",
             "", "| head | ms per call | peak GiB above the inputs | log-prob error max | grad h rel. | grad W rel. |",
             "| --- " * 6 + "|"]
    lines += [f"| {h['head']} | {h['ms']:.2f} | {h['peak_extra_gib']:.2f} | {h['logprob_err_max']:.2e} | "
              f"{h['grad_hidden_rel_err']:.2e} | {h['grad_weight_rel_err']:.2e} |" for h in report["heads"]]
    (args.out / "logprob_head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
