"""One mixture-of-experts layer's training forward and backward, per experts implementation, on one GPU:
which implementation the HF backend should train with (docs/benchmarks.md, "A mixture of experts on
one GPU").

    python scripts/bench/run.py moe-experts --out bench_out/moe_experts
    python scripts/bench/run.py moe-experts --tokens 64 --steps 2 --device cpu   # the harness itself

A Qwen3-MoE sparse block (transformers' `Qwen3MoeSparseMoeBlock` from its config class: router, softmax
top-k renormalised, stacked SwiGLU experts) of the `moe` benchmark's layer shape, random bf16 weights,
forward and backward of a [1, tokens, hidden] input, for each implementation:
  transformers  transformers' `grouped_mm` experts (its default on a GPU);
  ours          the same function compiled (aligner_ext.models.experts, what the HF backend trains with);
  liger         Liger-Kernel's fused MoE (Triton grouped GEMMs with the gather and SwiGLU fused);
and, as the floor of the layer's matrix work, the two grouped products alone (forward and backward) on
the same expert counts. Each: the median time over --steps after --warmup, MFU of the expert and router
products (6 x rows x parameters), peak memory above the inputs, and the relative error of the output
and every gradient against transformers' eager experts in float32 on the same weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from common import device_times  # noqa: E402

IMPLEMENTATIONS = ("transformers", "ours", "liger")


def register_candidates() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from aligner_ext.models import experts

    ALL_EXPERTS_FUNCTIONS.register(experts.IMPLEMENTATION, experts.compiled_grouped_mm())
    try:
        from liger_kernel.transformers.swiglu import LigerExperts

        ALL_EXPERTS_FUNCTIONS.register("liger", LigerExperts.forward)
    except ImportError:
        pass


def implementation_name(name: str) -> str:
    from aligner_ext.models import experts

    return {"transformers": "grouped_mm", "ours": experts.IMPLEMENTATION}.get(name, name)


def block(args, implementation: str, dtype: torch.dtype, state: dict | None = None):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True)
    config._experts_implementation = implementation
    module = Qwen3MoeSparseMoeBlock(config)
    if state is None:
        generator = torch.Generator().manual_seed(0)
        state = {name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in module.named_parameters()}
    module.load_state_dict(state)
    return module.to(args.device, dtype), state


def forward_backward(module, hidden: torch.Tensor, grad: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    hidden.grad = None
    module(hidden).backward(grad)


def outputs(module, hidden: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    forward_backward(module, hidden, grad)
    values = {"output": module(hidden).detach().float(), "grad_input": hidden.grad.float()}
    values.update({f"grad_{name}": p.grad.float() for name, p in module.named_parameters()})
    return values


def relative_errors(values: dict, reference: dict) -> dict[str, float]:
    return {key: float((values[key] - reference[key].to(values[key].device)).norm() / reference[key].norm())
            for key in reference}


def grouped_products_only(module, hidden: torch.Tensor, grad: torch.Tensor):
    """The two grouped products of the block's routing, forward and backward, nothing else."""
    experts = module.experts
    hidden, grad = hidden.view(-1, hidden.shape[-1]), grad.view(-1, grad.shape[-1])
    with torch.no_grad():
        _, _, chosen = module.gate(hidden)
        ids, perm = torch.sort(chosen.reshape(-1))
        counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=experts.num_experts,
                             min=0, max=experts.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = hidden.detach()[perm // chosen.shape[-1]].contiguous().requires_grad_()
        down_grad = grad[perm // chosen.shape[-1]].contiguous()

    def run() -> None:
        gate_up = torch._grouped_mm(rows, experts.gate_up_proj.transpose(-2, -1), offs=offsets)
        down = torch._grouped_mm(gate_up[:, :experts.intermediate_dim], experts.down_proj.transpose(-2, -1),
                                 offs=offsets)
        down.backward(down_grad)

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="3072,12288", help="comma-separated token counts (micro-batch x length)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench_out/moe_experts")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    register_candidates()
    from grpo_step import measure_hardware

    hardware = measure_hardware(args.device) if args.device == "cuda" else {"matmul_flops_per_s": float("nan")}
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    names = [name for name in args.implementations.split(",") if implementation_name(name) in ALL_EXPERTS_FUNCTIONS]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    params = args.top_k * 3 * args.hidden * args.intermediate + args.experts * args.hidden
    report = {"shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "experts", "top_k")},
              "hardware": hardware, "runs": {}}
    reference_module, state = block(args, "eager", torch.float32)
    lines = [f"# One MoE layer, forward and backward (hidden {args.hidden}, {args.experts} experts of "
             f"{args.intermediate}, top-{args.top_k})", "",
             "| tokens | implementation | ms (median) | MFU | peak MiB | max relative error |", "| --- " * 6 + "|"]
    for tokens in (int(t) for t in args.tokens.split(",")):
        generator = torch.Generator().manual_seed(tokens)
        hidden32 = torch.randn(1, tokens, args.hidden, generator=generator)
        grad32 = torch.randn(1, tokens, args.hidden, generator=generator)
        reference = outputs(reference_module, hidden32.to(args.device).requires_grad_(), grad32.to(args.device))
        flops = 6 * tokens * params
        for name in [*names, "grouped_products_only"]:
            module, _ = block(args, implementation_name(name if name != "grouped_products_only" else "transformers"),
                              dtype, state)
            hidden = hidden32.to(args.device, dtype).requires_grad_()
            grad = grad32.to(args.device, dtype)
            errors = {}
            if name != "grouped_products_only":
                errors = relative_errors(outputs(module, hidden, grad), reference)
                fn = lambda: forward_backward(module, hidden, grad)  # noqa: E731
            else:
                fn = grouped_products_only(module, hidden, grad)
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            device_times(fn, args.warmup, args.device)
            times = device_times(fn, args.steps, args.device)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if args.device == "cuda" else float("nan")
            median = statistics.median(times)
            mfu = flops / median / hardware["matmul_flops_per_s"]
            report["runs"].setdefault(str(tokens), {})[name] = {"ms": 1e3 * median, "times_s": times, "mfu": mfu,
                                                                "peak_mib": peak, "relative_errors": errors}
            worst = max(errors.values()) if errors else float("nan")
            lines.append(f"| {tokens} | {name} | {1e3 * median:.3f} | {100 * mfu:.1f}% | {peak:.0f} | {worst:.2e} |")
            print(lines[-1], flush=True)
    (out / "moe_experts.md").write_text("\n".join(lines) + "\n")
    (out / "moe_experts.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
