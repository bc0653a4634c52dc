"""The GRPO step at one model shape on one GPU, ours against TRL's GRPOTrainer, for a workload each
(`--workload`, named by run.py's subcommand):

  lora  a Llama-3.1-8B-shape model trained through LoRA adapters, the same peft config in both systems
        (docs/lora.md);
  moe   a Qwen3-MoE model scaled to one GPU (docs/benchmarks.md, "A mixture of experts on one GPU").

    python scripts/bench/run.py lora --out bench_out/lora_step           # one H100 (80 GB) or H200
    python scripts/bench/run.py moe --out bench_out/moe_step
    python scripts/bench/run.py lora --tiny --out bench_out/lora_tiny   # the harness itself, on the CPU
    python scripts/bench/run.py lora --systems ours,prev:ours --prev COMMIT --layers 8   # before / after

A before / after runs `prev:ours` with the library of --prev's tree on the same workspace, and the
report ends with the ratios after / before (grpo_step.py's); `--layers 8` makes an 8-layer model of the
same layer shape, for a cheaper workspace and profile (its figures are not the full model's).

One call runs, each in its own process and one after another (the device otherwise idle):
  1. the workspace worker: the workload's model with random bf16 weights (from transformers' config
     class through `family_config`), the word tokenizer and prompt rows of grpo_step_lib, the matrix
     rate and copy bandwidth, and the float32 log-probs of the probe (grpo_step.py's reference worker,
     on this model);
  2. ours: grpo_step_ours.py with the rollout engine and the workload's settings (lora:
     `policy.lora.rank=32 policy.lora.alpha=64` on every attention and MLP projection);
  3. when named in --systems, ours with more settings (OURS_EXTRA): ours_megatron on the Megatron
     backend with its distributed optimizer, packed under one HF micro-batch's tokens; ours_replay
     (a mixture of experts) with routing replay. A mixture of experts' runs report the share of
     (token, layer) pairs whose experts differ between the engine and the trainer (`moe/routing_mismatch`);
  4. TRL: grpo_step_trl.py in its fastest mode without vLLM ("fast": bf16 weights, no gradient
     checkpointing; lora: with `peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear")`,
     which GRPOTrainer takes as its constructor argument);
then writes `shape_step.md` and `shape_step.json` under --out: grpo_step.py's table (step time, phases,
peak memory of generation and training, decode-bound share, train MFU), the slots the rollout engine
sized from free memory, and the workload's targets. For a mixture of experts the floors count the
expert weights a decode step reads (the experts its batch's tokens choose: all of them at 256 tokens of
top-8 of 32) and the training FLOPs of the active parameters (grpo_step_lib.model_counts).

Every response is exactly R tokens (EOS ignored), the same learning rate, KL off, one optimizer update
per step: the GRPO benchmark's identical work (scripts/bench/grpo_step.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import prev_tree  # noqa: E402
from grpo_step import (  # noqa: E402
    PREV_PREFIX,
    ROOT,
    floors,
    measure_hardware,
    reference_logprobs,
    relative_error,
    render,
    run_worker,
    summarise,
)
from grpo_step_lib import Preset, build_word_tokenizer, write_json, write_workspace  # noqa: E402

RANK, ALPHA = 32, 64
# Systems of ours with settings added to ours': the Megatron backend with its distributed optimizer,
# sequences packed under a budget of one HF micro-batch's tokens (added below); the trainer routing
# each token to the experts the engine chose
OURS_EXTRA = {"ours_megatron": ["policy.backend=megatron", "policy.use_distributed_optimizer=true"],
              "ours_replay": ["policy.routing_replay=true"]}
TINY_SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512,
                  prompts=2, n=4, prompt_length=24, response_length=16, micro_batch=8, device="cpu")


@dataclass(frozen=True)
class Workload:
    preset: Preset
    family: str  # family_configs name
    config: dict  # more fields of the HF config (beyond the preset's sizes)
    tiny_config: dict  # the same at the tiny size
    ours: tuple[str, ...]  # settings of our systems
    targets: str  # what the report's last line checks


WORKLOADS = {
    # Llama-3.1-8B's shape: hidden 4096, 32 layers, 32 / 8 heads, MLP 14336, an untied 128,256-entry
    # vocabulary; 32 prompts x 8, P 256 + R 1024 (the KV cache of 256 x 1280 tokens is about 43 GB)
    "lora": Workload(
        Preset("llama3_8b_lora", "words", 4096, 32, 32, 8, 14336, 128256, prompts=32, n=8, prompt_length=256,
               response_length=1024, micro_batch=2, device="cuda", variant_steps=0),
        "llama3", dict(tie_word_embeddings=False), {},
        (f"policy.lora.rank={RANK}", f"policy.lora.alpha={ALPHA}"),
        "step >= 3x TRL's; decoding >= 40% of the decode bound (base weights + KV cache read per step)"),
    # Qwen3-30B-A3B's layer (top-8 routing renormalised, 4 key-value heads of 128, its 151,936-entry
    # vocabulary) at 48 layers of 32 experts of width 512 around hidden 1024: 3.0B parameters, 0.86B
    # active besides the head
    "moe": Workload(
        Preset("qwen3_moe_3b", "words", 1024, 48, 16, 4, 512, 151936, prompts=32, n=8, prompt_length=256,
               response_length=512, micro_batch=4, device="cuda", variant_steps=0),
        "qwen3_moe", dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512, head_dim=128,
                          tie_word_embeddings=False),
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16), (),
        "step >= 3x TRL's; decoding >= 30% of the decode bound (the experts read counted); training >= 30% MFU on "
        "active parameters"),
}


def selected(args) -> tuple[Workload, Preset]:
    """The workload and its preset: tiny with --tiny, shallower with `--layers` (the same layer shape,
    for a cheap profile)."""
    workload = WORKLOADS[args.workload]
    preset = replace(workload.preset, name=f"tiny_{args.workload}", **TINY_SIZES) if args.tiny else workload.preset
    if args.layers:
        preset = replace(preset, name=f"{preset.name}_{args.layers}_layers", num_layers=args.layers)
    if args.micro_batch:
        preset = replace(preset, name=f"{preset.name}_micro_batch_{args.micro_batch}", micro_batch=args.micro_batch)
    return workload, preset


def workspace_worker(args) -> None:
    """The model, rows and probe of the workspace; the hardware's rates; the probe's reference log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    from aligner_ext.models.family_configs import family_config

    workload, preset = selected(args)
    config = family_config(workload.family, hidden_size=preset.hidden_size, num_hidden_layers=preset.num_layers,
                           num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads,
                           intermediate_size=preset.intermediate_size, vocab_size=preset.vocab_size,
                           max_position_embeddings=preset.prompt_length + preset.response_length + 512,
                           **(workload.tiny_config if args.tiny else workload.config))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if preset.device == "cuda" else torch.float32
    with torch.device(preset.device):  # random initialisation on the GPU: minutes on the host at 8B
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # never a float32 copy
    rows = preset.prompts * (args.warmup + args.steps) * 2
    counts = write_workspace(preset, rows, args.out / "work", model_and_tokenizer=(model, build_word_tokenizer(
        preset.vocab_size)))
    del model
    torch.save(reference_logprobs(args.out / "work", preset.device), args.out / "reference.probe.pt")
    write_json(args.out / "workspace.json", {**measure_hardware(preset.device), "model": counts})


def trl_worker(args) -> None:
    """grpo_step_trl.py's worker; for LoRA with GRPOTrainer given the peft config."""
    import functools

    import grpo_step_trl
    import trl
    from peft import LoraConfig

    if args.workload == "lora":
        peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear")
        trl.GRPOTrainer = functools.partial(trl.GRPOTrainer, peft_config=peft_config)
    sys.argv = [sys.argv[0], "--workspace", str(args.out / "work"), "--out", str(args.out / "trl_fast.json"),
                "--mode", "fast", "--warmup", str(args.warmup), "--steps", str(args.steps), "--lr", str(args.lr)]
    grpo_step_trl.main()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="lora")
    parser.add_argument("--out", type=Path, default=None, help="default: bench_out/<workload>_step")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per system")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the harness")
    parser.add_argument("--systems", default="ours,trl_fast",
                        help="comma-separated, from ours, ours_megatron, ours_replay, prev:ours, trl_fast; a system left out whose result is in --out from "
                             "an earlier call (on the same workspace) is reported from it, so two calls can split one run")
    parser.add_argument("--prev", type=prev_tree, default=None,
                        help="an earlier commit or its tree: the system prev:ours runs with its library (before / after)")
    parser.add_argument("--layers", type=int, default=0, help="this many layers instead of the preset's (the same "
                        "layer shape, a cheaper workspace for --torch-profile); its figures are not the full model's")
    parser.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch in every system "
                        "instead of the preset's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more config override of every ours system (repeatable), e.g. policy.kernels=none")
    parser.add_argument("--torch-profile", default="", help="phases of one more step of ours under torch.profiler "
                        "(<out>/ours.torch_profile.txt), as in grpo_step.py")
    parser.add_argument("--workspace-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = (args.out or Path("bench_out") / f"{args.workload}_step").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.workspace_worker:
        return workspace_worker(args)
    if args.trl_worker:
        return trl_worker(args)

    import torch

    workload, preset = selected(args)
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--lr", str(args.lr)]
    itself = [sys.executable, __file__, "--workload", args.workload, "--out", str(args.out), *common,
              *(["--tiny"] if args.tiny else []), "--layers", str(args.layers),
              "--micro-batch", str(args.micro_batch)]
    if not (args.out / "workspace.json").is_file():  # an earlier call's workspace is reused
        _, failure = run_worker("workspace", [*itself, "--workspace-worker"], args.out, args.timeout)
        if failure:
            sys.exit(f"the workspace worker failed: {failure}")
    hardware = json.loads((args.out / "workspace.json").read_text())
    def ours_command(system: str) -> list[str]:
        stem = system.replace(":", "_")  # file names without the colon
        profile = ["--torch-profile", args.torch_profile] if args.torch_profile and system == "ours" else []
        settings = [*workload.ours, *OURS_EXTRA.get(system, []), *args.set]
        if system == "ours_megatron":
            settings.append(f"policy.micro_batch_tokens={preset.micro_batch * (preset.prompt_length + preset.response_length)}")
        return [sys.executable, str(HERE / "grpo_step_ours.py"), "--workspace", str(args.out / "work"),
                "--out", str(args.out / f"{stem}.json"), "--engine", "rollout", "--system", system, *common,
                *[arg for setting in settings for arg in ("--set", setting)], *profile]

    results, failures = {}, {}
    chosen = args.systems.split(",")
    if PREV_PREFIX + "ours" in chosen and args.prev is None:
        sys.exit("prev:ours: name the earlier tree with --prev")
    workers = (("ours", ours_command("ours"), ROOT), *((name, ours_command(name), ROOT) for name in OURS_EXTRA),
               (PREV_PREFIX + "ours", ours_command(PREV_PREFIX + "ours"), args.prev),
               ("trl_fast", [*itself, "--trl-worker"], ROOT))
    for name, command, root in workers:
        stem = name.replace(":", "_")
        if name not in chosen:
            if (args.out / f"{stem}.json").is_file():
                results[name] = json.loads((args.out / f"{stem}.json").read_text())
            continue
        result, failure = run_worker(stem, command, args.out, args.timeout, root)
        if result is None:
            failures[name] = failure
        else:
            results[name] = result
    floor = floors(preset, hardware)
    systems = {}
    for name, result in results.items():
        try:
            systems[name] = summarise(result, preset, floor, hardware)
            mismatch = [step["metrics"]["moe/routing_mismatch"] for step in result["steps"][result["warmup_steps"]:]
                        if "moe/routing_mismatch" in step.get("metrics", {})]
            if mismatch:  # every measured step's, as the run logged it
                systems[name]["routing_mismatch"] = mismatch
        except (ValueError, ZeroDivisionError, statistics.StatisticsError):  # stopped before a measured step
            times = [round(step["step_s"], 1) for step in result["steps"]]
            failures[name] = f"stopped at its time limit after {len(times)} steps ({times} s), none measured"
    # the probe's log-probs against the float32 reference (where both files are here: a report rendered
    # again elsewhere from the JSON files alone has none)
    probes = {name: args.out / f"{name.replace(':', '_')}.probe.pt" for name in results}
    reference = args.out / "reference.probe.pt"
    checks = {name: relative_error(torch.load(path), torch.load(reference))
              for name, path in probes.items() if path.is_file() and reference.is_file()}
    report = {"date": datetime.date.today().isoformat(), "preset": asdict(preset), "hardware": hardware,
              "floor": floor, "systems": systems, "variants": {}, "logprob_check": checks, "failures": failures,
              "workload": args.workload, "engine_slots": results.get("ours", {}).get("steps", [{}])[0].get("engine_last_call", {})}
    if args.workload == "lora":
        report["lora"] = {"rank": RANK, "alpha": ALPHA, "targets": "every attention and MLP projection"}
    lines = [f"Workload {args.workload}: {' '.join(workload.ours) or 'full training'}.", "",
             render(report), "", f"The rollout engine's first call: {report['engine_slots']}"]
    for name in ("ours", *OURS_EXTRA):
        if name in systems and "trl_fast" in systems:
            ours = systems[name]
            lines += ["", f"{name}: step {systems['trl_fast']['step_s'][0] / ours['step_s'][0]:.2f}x TRL's, decoding at "
                      f"{100 * ours['decode_bound_share']:.1f}% of the decode bound, training at "
                      f"{100 * ours['train_mfu']:.1f}% MFU (targets: {workload.targets})."]
    lines += [f"{name}: engine and trainer chose different experts for {', '.join(f'{100 * share:.3f}%' for share in s['routing_mismatch'])} "
              "of (token, layer) pairs in the measured steps" for name, s in systems.items() if "routing_mismatch" in s]
    (args.out / "shape_step.md").write_text("\n".join(lines) + "\n")
    write_json(args.out / "shape_step.json", report)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
