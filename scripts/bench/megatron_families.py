"""The Megatron backend's training step of each family at ~1B on one GPU: MFU over more calls than
scripts/bench/families.py takes, and a profile of where one train call's device time goes.

    python scripts/bench/run.py megatron --families llama3,gemma3_text,olmo2 --steps 6 --profile
    python scripts/bench/run.py megatron --families llama3,olmo2 --prev 7ed92df --steps 6   # before / after
    python scripts/bench/run.py megatron --tiny --families olmo2 --steps 1 --profile        # the CPU (tests/bench)
    python scripts/bench/run.py megatron --families qwen3_moe --layers 4 --prev 11deeec --profile  # Qwen3-30B-A3B's layer

Per family (families.py's config at SIZES, random weights, bf16 on the GPU; its workload: 8 prompts x
n=8 of P 128 + R 256, packed micro-batches of --tokens (MEGATRON_TOKENS) at TP=1), in its own process: old
log-probs and one update per call, --steps calls timed after --warmup calls (families.megatron_calls);
MFU as families.py defines it (train FLOPs of the real tokens over the train call's time and the
measured bf16 matrix rate). With --prev (an earlier commit, or its tree), each family runs
first with that tree's library (`prev:<family>`), then with this tree's, one after the other; the table
gives the ratio of the train call after / before.

--profile (this tree's side): one more train call under torch.profiler with every layer's parts
annotated: the device time of the kernels by kind (grpo_step_lib.KERNEL_KINDS) and the top kernels;
the forward of each part of a layer (record_function ranges `fwd:<part>`, summed over layers and
micro-batches: input norm, q/k/v product, q/k norms, core attention (RoPE, attention), output
product, post-norms, MLP products and activation), the embedding, the final norm and the log-prob
head (forward and backward), the optimizer step and the weights' norms; and the backward by autograd
node; and the host's busiest operators. Writes megatron_families.md / .json and <family>.profile.txt
under --out.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import prev_tree, steps_line  # noqa: E402
from families import (  # noqa: E402
    MEGATRON_TOKENS,
    driver_arguments,
    driver_setup,
    family_preset,
    full_batch,
    megatron_calls,
    megatron_policy,
    shape,
    train_flops,
)
from grpo_step import PREV_PREFIX, run_worker  # noqa: E402
from grpo_step_lib import kernel_summary, render_summary, start_profile, write_json  # noqa: E402

# A layer's parts, by their module path inside megatron-core's TransformerLayer (ours where it has none).
LAYER_PARTS = ("input_layernorm", "self_attention.linear_qkv", "self_attention.q_layernorm",
               "self_attention.k_layernorm", "self_attention.core_attention", "self_attention.linear_proj",
               "self_attention.output_norm", "self_attention", "pre_mlp_layernorm", "mlp.linear_fc1",
               "mlp.linear_fc2", "mlp.output_norm", "mlp")


class Annotations:
    """record_function ranges `fwd:<name>` around the forwards of the given modules (profiler only)."""

    def __init__(self):
        self.undo, self.open = [], {}

    def add(self, module, name: str) -> None:
        import torch

        def enter(module, args):
            scope = torch.profiler.record_function(f"fwd:{name}")
            scope.__enter__()
            self.open.setdefault(id(module), []).append(scope)

        def leave(module, args, output):
            self.open[id(module)].pop().__exit__(None, None, None)

        for handle in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave)):
            self.undo.append(handle.remove)

    def wrap(self, owner, attribute: str, name: str) -> None:
        """`owner.attribute` (a function, looked up there by its callers) run inside a range `name`."""
        import torch

        inner = getattr(owner, attribute)

        def annotated(*args, **kwargs):
            with torch.profiler.record_function(name):
                return inner(*args, **kwargs)

        setattr(owner, attribute, annotated)
        self.undo.append(lambda: setattr(owner, attribute, inner))

    def remove(self) -> None:
        for undo in self.undo:
            undo()


def profile_train(policy, batch, device: str) -> dict:
    """One train call under torch.profiler with the module docstring's annotations: `kernel_summary`."""
    import torch

    from aligner_ext.losses.clipped_pg import ClippedPGLoss
    from aligner_ext.models.megatron import forward
    from aligner_ext.models.megatron import policy as policy_module

    core = policy.core
    notes = Annotations()
    for layer in core.decoder.layers:
        modules = dict(layer.named_modules())
        for part in LAYER_PARTS:
            if part in modules and type(modules[part]).__name__ != "IdentityOp":
                notes.add(modules[part], part)
    if core.pre_process:
        notes.add(core.embedding, "embedding")
    if getattr(core.decoder, "final_layernorm", None) is not None:
        notes.add(core.decoder.final_layernorm, "final_layernorm")
    notes.wrap(forward, "vocab_parallel_logprobs", "fwd:log-prob head")
    notes.wrap(policy_module, "clipped_step", "step:optimizer (clip, Adam)")
    notes.wrap(type(policy), "_weights_norm", "step:weights' norm")
    notes.wrap(policy_module, "forward_backward", "step:forward and backward")
    loss = ClippedPGLoss(ClippedPGLoss.Config())
    try:
        session = start_profile(device == "cuda")
        started = time.perf_counter()
        policy.train(batch, loss, 1.0)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        session.__exit__(None, None, None)
    finally:
        notes.remove()
    summary = kernel_summary(session, top=30, ranges="")
    summary["ranges_s"] = {name: seconds for name, seconds in summary["ranges_s"].items()
                           if name.startswith(("fwd:", "step:"))}
    return {"wall_s": wall, **summary}


def worker(args) -> None:
    import torch

    name = args.worker.removeprefix(PREV_PREFIX)
    config, preset = family_preset(name, args.tiny, **({"num_hidden_layers": args.layers} if args.layers else {}))
    device = preset.device
    torch.manual_seed(0)
    with torch.device(device):  # random initialisation on the GPU
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    policy = megatron_policy(model, preset, args.lr, args.warmup + args.steps + 1, tokens=args.tokens)
    del model
    batch = full_batch(preset, config.vocab_size)
    calls = megatron_calls(policy, batch, device, args.steps, args.warmup)
    result = {"family": name, "model": shape(config), "preset": preset.__dict__, "kernels": policy.kernels,
              "calls": calls}
    if args.profile and not args.worker.startswith(PREV_PREFIX):
        result["profile"] = profile_train(policy, batch, device)
        layers = config.num_hidden_layers
        (args.out / f"{name}.profile.txt").write_text(
            render_summary(f"{name}: one train call ({layers} layers; wall {result['profile']['wall_s']:.3f} s)",
                           result["profile"]) + "\n")
    write_json(args.out / f"{args.worker.replace(':', '_')}.json", result)


def summarise(result: dict, hardware: dict) -> dict:
    model, preset = result["model"], result["preset"]
    sequences = preset["prompts"] * preset["n"]
    flops = train_flops(model, [preset["prompt_length"] + preset["response_length"]] * sequences,
                        [preset["response_length"]] * sequences)
    train = [call["phases_s"]["train"] for call in result["calls"]]
    median = statistics.median(train)
    return {"params": model["body_matmul_params"] + model["head_params"], "kernels": result["kernels"],
            "train_s": [median, min(train), max(train)], "train_mfu": flops / median / hardware["matmul_flops_per_s"],
            "mfu_range": [flops / max(train) / hardware["matmul_flops_per_s"],
                          flops / min(train) / hardware["matmul_flops_per_s"]],
            "logprobs_s": statistics.median(call["phases_s"]["logprobs"] for call in result["calls"]),
            "peak_gib": max(call["peak_gib"].get("train", 0.0) for call in result["calls"]),
            "profile": result.get("profile"),
            "calls": [{"train_s": call["phases_s"]["train"], "events": call.get("events", {})} for call in result["calls"]]}


def render(report: dict) -> str:
    hardware, rows = report["hardware"], report["families"]
    lines = [f"Megatron backend, TP=1, one train call of 64 sequences x (P 128 + R 256) in micro-batches of "
             f"{report['tokens']} tokens ({report['date']}, {hardware['device_name']}; {hardware['matmul']} "
             f"{hardware['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s; {report['steps']} calls after {report['warmup']}):", "",
             "| family | tree | params | train s, median [min, max] | MFU [range] | vs the earlier tree | "
             "log-probs s | peak GiB |", "| --- " * 8 + "|"]
    for key, s in rows.items():
        if "failed" in s:
            lines.append(f"| {key} | failed: {s['failed']} |" + " - |" * 6)
            continue
        name = key.removeprefix(PREV_PREFIX)
        before = rows.get(PREV_PREFIX + name) if key == name else None
        ratio = f"{s['train_s'][0] / before['train_s'][0]:.3f}" if before and "train_s" in before else "-"
        lines.append(f"| {name} | {'earlier' if key != name else 'this'} | {s['params'] / 1e9:.2f}B | "
                     f"{s['train_s'][0]:.3f} [{s['train_s'][1]:.3f}, {s['train_s'][2]:.3f}] | "
                     f"{100 * s['train_mfu']:.1f}% [{100 * s['mfu_range'][0]:.1f}, {100 * s['mfu_range'][1]:.1f}] | "
                     f"{ratio} | {s['logprobs_s']:.3f} | {s['peak_gib']:.1f} |")
    lines += ["", "Every timed train call, seconds (* above 1.3x the median, with what happened in it):", ""]
    lines += [f"- {steps_line(key, s['calls'], 'train_s')}" for key, s in rows.items() if "calls" in s]
    for key, s in rows.items():
        if s.get("profile"):
            lines += ["", "```", render_summary(f"{key}: one train call, wall {s['profile']['wall_s']:.3f} s",
                                                s["profile"]), "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="llama3,gemma3_text,olmo2")
    parser.add_argument("--steps", type=int, default=6, help="timed train calls after the warm-up calls")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (compilation; the first calls "
                        "after it still run slower on a GPU)")
    parser.add_argument("--profile", action="store_true", help="one more call under torch.profiler (this tree's side)")
    parser.add_argument("--prev", type=prev_tree, default=None,
                        help="an earlier commit or its tree: each family runs first with its library")
    parser.add_argument("--prev-families", default=None, help="only these families run with --prev's library too "
                        "(default: every family; one whose code did not change needs no earlier side)")
    parser.add_argument("--tokens", type=int, default=MEGATRON_TOKENS, help="policy.micro_batch_tokens")
    parser.add_argument("--layers", type=int, default=None, help="each family's layers (default: SIZES'); a mixture "
                        "of experts at the GPU size fits one GPU with its Adam state at a few")
    driver_arguments(parser, timeout=300)
    args = parser.parse_args(argv)
    hardware = driver_setup(args, "megatron_families")
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    report = {"date": datetime.date.today().isoformat(), "hardware": hardware, "steps": args.steps, "warmup": args.warmup, "tokens": args.tokens,
              "command": " ".join(sys.argv[1:] if argv is None else argv), "families": {}}
    common = ["--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
              "--tokens", str(args.tokens)]
    common += ["--tiny"] if args.tiny else []
    common += ["--profile"] if args.profile else []
    common += ["--layers", str(args.layers)] if args.layers else []
    families = [family for family in args.families.split(",") if family]
    earlier = families if args.prev_families is None else args.prev_families.split(",")
    for name in families:
        sides = [(PREV_PREFIX + name, args.prev)] if args.prev and name in earlier else []
        for key, root in sides + [(name, HERE.parent.parent)]:
            left = min(args.timeout, args.budget - (time.perf_counter() - started))
            stem = key.replace(":", "_")
            result, why = run_worker(stem, [sys.executable, __file__, "--worker", key, *common], args.out, left, root)
            report["families"][key] = summarise(result, hardware) if result else {"failed": why}
            write_json(args.out / "megatron_families.json", report)
            (args.out / "megatron_families.md").write_text(render(report) + "\n")
    print(render(report))


if __name__ == "__main__":
    main()
