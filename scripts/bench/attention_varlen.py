"""Causal attention over sequences of different lengths, forward + backward: padded rows against packed.

    python scripts/bench/attention_varlen.py [--heads 12 --kv-heads 2 --head-dim 128 --rows 16]

The choice behind packed micro-batches (models/attention.py): B sequences of random lengths
(--min..--max tokens) in bf16 on one GPU, as
  padded     [B, heads, max, d] through SDPA, causal (what an unpacked micro-batch computes);
  varlen     all sequences in one [T, heads, d] through `torch.nn.attention.varlen.varlen_attn`
             (FlashAttention on cumulative lengths; key/value heads repeated where it has no GQA);
  per_doc    the packed tensor cut per sequence, SDPA causal on each (the CPU path).
Each is checked against per_doc in float32 on the packed tokens, then timed (median of --repeats).
Prints one JSON line and writes it to --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--min", type=int, default=192)
    parser.add_argument("--max", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="attention_varlen.json")
    args = parser.parse_args()
    from torch.nn.attention.varlen import varlen_attn

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min, args.max + 1, (args.rows,), generator=gen)
    total, width = int(lengths.sum()), int(lengths.max())
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).cuda()
    device, dtype = "cuda", torch.bfloat16
    q = torch.randn(total, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(total, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def per_doc(q, k, v):
        parts = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True)
                 for a, b in bounds]
        return torch.cat([p.transpose(0, 1) for p in parts])

    gqa_argument = "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch 2.11 has none

    def varlen(q, k, v):
        if gqa_argument:
            return varlen_attn(q, k, v, cu, cu, width, width, window_size=(-1, 0), enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, width, width, window_size=(-1, 0))

    def to_rows(t):
        rows = t.new_zeros(args.rows, width, *t.shape[1:])
        for index, (a, b) in enumerate(bounds):
            rows[index, : b - a] = t[a:b]
        return rows.transpose(1, 2)  # [B, heads, width, d]

    padded_q, padded_k, padded_v = (to_rows(t.detach()).requires_grad_() for t in (q, k, v))
    padded_grad = to_rows(grad)

    def padded():
        out = F.scaled_dot_product_attention(padded_q, padded_k, padded_v, is_causal=True, enable_gqa=True)
        out.backward(padded_grad)

    def packed(fn):
        def run():
            fn(q, k, v).backward(grad)
        return run

    reference = per_doc(q.float(), k.float(), v.float())
    result = {"signature": str(inspect.signature(varlen_attn)), "rows": args.rows, "tokens": total,
              "padded_positions": args.rows * width, "torch": torch.__version__,
              "varlen_max_err_vs_fp32": float((varlen(q, k, v).float() - reference).abs().max()),
              "per_doc_max_err_vs_fp32": float((per_doc(q, k, v).float() - reference).abs().max())}
    for name, fn in (("padded", padded), ("varlen", packed(varlen)), ("per_doc", packed(per_doc))):
        result[f"{name}_fwd_bwd_ms"] = 1e3 * timed(fn, args.repeats)
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as handle:
        handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
