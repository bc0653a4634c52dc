"""The rollout engine's sampler alone (generation/sampler.py), compiled as the engine compiles it, at a
decode step's shape: rows x vocabulary bf16 logits, temperature 1 (the Gumbel race) and greedy, and
the Triton race (sample_kernel.py, what a compiled engine draws with at temperature > 0); with
--previous DIR, also the sampler of an earlier checkout (DIR holds its tree), whose tokens must be
identical for the same requests.

    python scripts/bench/sampler.py --rows 256 --vocab 151936 [--previous .prev]   # one GPU

Each sampler's call is captured 20 times in one CUDA graph and the graph replayed 10 times:
microseconds per call, and the logits' bytes over that time as a share of the copy bandwidth.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from decode_attention import graph_time, module_of_tree  # noqa: E402
from grpo_step import measure_hardware  # noqa: E402
from aligner_ext.generation import sample_kernel, sampler  # noqa: E402


def engine_step(module):
    """`module`'s sampler compiled as the engine compiles it: (logits, T, seeds, counters) -> tokens, log-probs."""
    compiled = torch.compile(module.sample, dynamic=True)
    return lambda logits, temperature, seeds, counters: compiled(logits, temperature, 1.0, 0, seeds, counters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--previous", type=Path, default=None)
    args = parser.parse_args()
    bandwidth = measure_hardware("cuda")["copy_bytes_per_s"]
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 3
    seeds = torch.tensor([sampler.request_seed(1, i) for i in range(args.rows)], device="cuda")
    counters = torch.full((args.rows,), 7, device="cuda")
    steps = {"current": engine_step(sampler)}
    if args.previous:
        steps["previous"] = engine_step(module_of_tree(args.previous, "aligner_ext/generation/sampler.py"))
    print(f"| sampler | temperature | us per call | share of the copy bandwidth (logits read once) | tokens as current |\n"
          f"| --- | --- | --- | --- | --- |")
    race = {"triton race": sample_kernel.gumbel_sample}  # temperature > 0 only
    for temperature in (1.0, 0.0):
        reference = steps["current"](logits, temperature, seeds, counters)[0]
        for name, step in {**steps, **(race if temperature > 0 else {})}.items():
            seconds = graph_time(lambda step=step: step(logits, temperature, seeds, counters))
            same = torch.equal(step(logits, temperature, seeds, counters)[0], reference)  # log() may round apart
            print(f"| {name} | {temperature} | {seconds * 1e6:.1f} | {logits.numel() * 2 / seconds / bandwidth:.0%} "
                  f"| {'identical' if same else 'DIFFERENT'} |", flush=True)


if __name__ == "__main__":
    main()
