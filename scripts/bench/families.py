"""Every dense family the library runs outside transformers, one GPU, ~1B random weights each: the
engine `generator.engine=auto` picks, decoding against its bound, training MFU on both policy
backends, the whole GRPO step and its peak memory.

    python scripts/bench/run.py families                                   # one GPU, every family
    python scripts/bench/run.py families --tiny --families qwen3,olmo2     # the CPU at a tiny size (tests/bench)

Per family of `models/family_configs.LAYOUTS`, in its own process (`--worker`), one after another:
  1. the family's config at SIZES (hidden 2048, 16 layers, 32 query / 8 key-value heads of 64, MLP
     8192: ~1B besides the embeddings; the family's own vocabulary, RoPE, windows, norms), random
     weights (seed 0, bf16 on the GPU), saved with a word tokenizer of that vocabulary and benchmark
     rows (scripts/bench/grpo_step_lib.py's workspace);
  2. the GRPO step as `aligner-ext train` runs it (HF backend, `generator.engine=auto`, EOS ignored
     so every response is R tokens): --warmup steps, then --steps measured, timed by phase with peak
     memory (grpo_step_lib.PhaseClock);
  3. the Megatron backend at TP=1 (packed micro-batches of MEGATRON_TOKENS) on a batch of the GRPO
     step's shape (random ids and advantages): old log-probs and `train`, --megatron-steps timed
     after --megatron-warmup calls (a train call takes ~0.5 s at 1B: a handful decides a 15% target).
A refusal (aligner_ext/support.py's line) or a failure of one part is reported in the table and the
others still run. Writes families.json and families.md under --out, rewritten after every family.

Formulas (W = bytes of the matrix weights, body + output head; k_l = K+V bytes per token of layer
l; w_l its sliding window, none = unbounded; B sequences, P prompt and R response tokens):
  decode bound   sum over t = 1..R of (W + B * sum_l k_l * min(P + t, w_l)) / measured copy bandwidth
  share of it    decode bound / generation phase time (prefill included)
  train FLOPs    per sequence of n tokens, r of them response: 6 * body * n + 6 * head * r
                 + sum_l 12 * heads * head_dim * n * min(n, w_l) (attention, no causal halving)
  MFU            train FLOPs / train phase time / measured matrix rate (bf16 8192^3 on the GPU)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import steps_line  # noqa: E402
from grpo_step import measure_hardware, run_worker  # noqa: E402
from grpo_step_lib import PhaseClock, Preset, model_counts, profiled_step, write_json, write_workspace  # noqa: E402

SIZES = {
    "gpu": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                intermediate_size=8192, max_position_embeddings=4096),
    # a small vocabulary keeps the CPU run in seconds (the GPU run keeps each family's own)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, max_position_embeddings=256, vocab_size=512),
}
# prompts x n sequences of P + R tokens per GRPO step (and per Megatron train call)
WORKLOADS = {"gpu": dict(prompts=8, n=8, prompt_length=128, response_length=256, micro_batch=16),
             "tiny": dict(prompts=2, n=2, prompt_length=16, response_length=8, micro_batch=4)}
MEGATRON_TOKENS = 8192  # policy.micro_batch_tokens of the Megatron train calls (packed micro-batches)


def one_line(err: BaseException) -> str:
    """How the table names a failure: its type and first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def shape(config) -> dict:
    """model_counts plus what the windows change: each layer's K+V values per token and window."""
    from aligner_ext.architecture import architecture

    counts = model_counts(config)
    counts["heads"] = config.num_attention_heads
    counts["kv_values_per_token_per_layer"] = counts["kv_values_per_token"] // counts["layers"]
    counts["windows"] = [plan.window for plan in architecture(config).layers]
    return counts


def decode_bound_s(model: dict, sequences: int, prompt: int, response: int, word: int, bandwidth: float) -> float:
    """Seconds to read the weights and every cached K/V (a windowed layer: its window) at each of the
    R decoding steps (module docstring)."""
    weights = (model["body_matmul_params"] + model["head_params"]) * word
    per_token = model["kv_values_per_token_per_layer"] * word
    total = 0.0
    for t in range(1, response + 1):
        cached = sum(min(prompt + t, window or prompt + t) for window in model["windows"])
        total += weights + sequences * per_token * cached
    return total / bandwidth


def train_flops(model: dict, lengths: list[int], responses: list[int]) -> float:
    """Training FLOPs of sequences of `lengths` tokens, `responses` of them scored (module docstring)."""
    attention = 12 * model["heads"] * model["head_dim"]
    return sum(6 * model["body_matmul_params"] * n + 6 * model["head_params"] * r
               + attention * sum(n * min(n, window or n) for window in model["windows"])
               for n, r in zip(lengths, responses))


# ---------------------------------------------------------------- the worker (one family)

def grpo_step(preset: Preset, workspace: Path, args) -> dict:
    """The loop's own step (`make_experience` + `update_policy`) as grpo_step_ours.py runs it, engine auto."""
    import torch
    from grpo_step_ours import GenerationLedger, overrides

    from aligner_ext.config import load_config
    from aligner_ext.trainer.build import build_components
    from aligner_ext.trainer.loop import update_policy
    from aligner_ext.trainer.metrics import StageTimer

    cfg = load_config("base", overrides(preset, workspace, "none", args.lr, "auto"))
    torch.manual_seed(cfg.trainer.seed)
    parts = build_components(cfg, workspace / "runs" / cfg.trainer.run_name)
    ledger = GenerationLedger(parts.engine, None)
    clock = PhaseClock(preset.device)
    for owner, method, phase in ((parts.engine, "generate", "generation"), (parts.rewards, "score", "rewards"),
                                 (parts.policy, "logprobs", "logprobs"), (parts.policy, "train", "train"),
                                 (parts.policy, "sync_weights", "weight_sync"),
                                 (parts.engine, "update_weights", "weight_sync")):
        clock.wrap(owner, method, phase)
    steps = []
    try:
        for step in range(args.warmup + args.steps):
            batch, _ = parts.maker.make_experience(parts.train_loader, step)
            if len(batch):
                update_policy(parts, batch, StageTimer(), cfg.rollout.temperature)
            record = clock.take_step()
            record["generated_tokens"] = sum(call["tokens"] for call in ledger.take())
            steps.append(record)
            print(f"[{preset.name}] GRPO step {step}: {record['step_s']:.2f} s", flush=True)
        if args.torch_profile:
            def step() -> None:
                batch, _ = parts.maker.make_experience(parts.train_loader, args.warmup + args.steps)
                if len(batch):
                    update_policy(parts, batch, StageTimer(), cfg.rollout.temperature)

            profiled_step(clock, args.torch_profile, step, args.out / f"{preset.name}.torch_profile.txt")
    finally:
        parts.rewards.close()
    return {"steps": steps[args.warmup:]}


def full_batch(preset: Preset, vocab: int):
    """The GRPO step's batch shape: prompts x n sequences of exactly P + R tokens, random ids and advantages."""
    import torch

    from aligner_ext.batch import ExperienceBatch, SampleInfo

    gen = torch.Generator().manual_seed(1)
    rows, prompt, response = preset.prompts * preset.n, preset.prompt_length, preset.response_length
    valid = torch.ones(rows, response, dtype=torch.bool)
    batch = ExperienceBatch(
        prompt_ids=torch.randint(1, vocab, (rows, prompt), generator=gen),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        response_ids=torch.randint(1, vocab, (rows, response), generator=gen), response_valid=valid,
        response_mask=valid, group_ids=torch.arange(rows) // preset.n,
        samples=[SampleInfo(row=None) for _ in range(rows)])
    batch.advantages = torch.randn(rows, 1, generator=gen).expand(rows, response).clone()
    return batch


def megatron_policy(model, preset: Preset, lr: float, steps: int, tokens: int = MEGATRON_TOKENS):
    """The Megatron backend's policy at TP=1 over `model` (an HF model), packed micro-batches of `tokens`."""
    from aligner_ext.models.megatron.policy import MegatronPolicy
    from aligner_ext.models.settings import OptimConfig, PolicyConfig

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return MegatronPolicy(model, PolicyConfig(backend="megatron", dtype=dtype, micro_batch_size=preset.micro_batch,
                                              micro_batch_tokens=tokens, optim=OptimConfig(lr=lr)),
                          total_steps=steps + 2)


def megatron_calls(policy, batch, device: str, steps: int, warmup: int = 1) -> list[dict]:
    """Old log-probs and one update per call, timed by phase (PhaseClock), after `warmup` calls."""
    from aligner_ext.losses.clipped_pg import ClippedPGLoss

    loss = ClippedPGLoss(ClippedPGLoss.Config())
    clock = PhaseClock(device)
    calls = []
    for _ in range(warmup + steps):
        clock.push("logprobs")
        batch.old_logprobs, _ = policy.logprobs(batch, 1.0)
        clock.pop()
        clock.push("train")
        policy.train(batch, loss, 1.0)
        clock.pop()
        calls.append(clock.take_step())
    return calls[warmup:]


def megatron_train(config, preset: Preset, workspace: Path, args) -> dict:
    """Old log-probs and one update per call on the GRPO step's batch shape, the policy at TP=1."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if preset.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=dtype)
    policy = megatron_policy(model, preset, args.lr, args.megatron_warmup + args.megatron_steps)
    return {"calls": megatron_calls(policy, full_batch(preset, config.vocab_size), preset.device, args.megatron_steps,
                                    args.megatron_warmup)}


def family_preset(name: str, tiny: bool, **overrides):
    """The HF config of family `name` at SIZES (`overrides` on top) and the workload as a Preset."""
    from aligner_ext.models.family_configs import family_config

    size = "tiny" if tiny else "gpu"
    config = family_config(name, **{**SIZES[size], **overrides})
    work = WORKLOADS[size]
    preset = Preset(name, "words", config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                    config.num_key_value_heads, config.intermediate_size, config.vocab_size, prompts=work["prompts"],
                    n=work["n"], prompt_length=work["prompt_length"], response_length=work["response_length"],
                    micro_batch=work["micro_batch"], device="cpu" if tiny else "cuda", variant_steps=1)
    return config, preset


def worker(args) -> None:
    """One family (module docstring): its JSON is rewritten after each part, so a crash keeps the parts before."""
    import torch
    from grpo_step_lib import build_word_tokenizer
    from transformers import AutoModelForCausalLM

    from aligner_ext.config import load_config
    from aligner_ext.support import megatron_refusal, rollout_refusal
    from aligner_ext.trainer.build import generation_engine_name

    name = args.worker
    config, preset = family_preset(name, args.tiny)
    device = preset.device
    result = {"family": name, "model_type": config.model_type, "model": shape(config), "preset": preset.__dict__,
              "auto_engine": generation_engine_name(load_config("base", []), config, torch.device(device)),
              "rollout_refusal": rollout_refusal(config)}
    workspace = args.out / "work" / name
    torch.manual_seed(0)
    with torch.device(device):  # random initialisation on the GPU: minutes on the host at 1B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    profiled = 1 if args.torch_profile else 0
    rows = preset.prompts * (args.warmup + args.steps + profiled)  # distinct prompts every step (the loader would cycle)
    write_workspace(preset, rows, workspace, model_and_tokenizer=(model, build_word_tokenizer(config.vocab_size)))
    del model

    def attempt(part) -> dict:
        """The part's result, or the one line of its failure (the next part still runs)."""
        try:
            return part()
        except Exception as err:
            traceback.print_exc()
            return {"failed": one_line(err)}
        finally:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()

    def megatron() -> dict:
        refusal = megatron_refusal(config)
        return {"refused": refusal} if refusal else megatron_train(config, preset, workspace, args)

    result["grpo"] = attempt(lambda: grpo_step(preset, workspace, args))
    write_json(args.out / f"{name}.json", result)
    result["megatron"] = attempt(megatron) if args.megatron_steps else {"failed": "not run (--megatron-steps 0)"}
    write_json(args.out / f"{name}.json", result)


# ---------------------------------------------------------------- the driver

def driver_arguments(parser, timeout: float) -> None:
    """The options every per-family benchmark of this folder shares (families.py, megatron_families.py,
    sliding_window.py): the CPU check, the learning rate, the time limits, the output folder."""
    parser.add_argument("--tiny", action="store_true", help="the CPU at the tiny size (checks the script runs)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per family (and tree)")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds for the whole run")
    parser.add_argument("--out", type=Path, default=None, help="default: bench_out/<script>[_tiny]")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def driver_setup(args, name: str) -> dict | None:
    """--out resolved and made; in the driver (not a worker), the measured hardware (the CPU run
    measures on smaller operands: seconds, not minutes, on two cores)."""
    args.out = (args.out or HERE.parent.parent / "bench_out" / (f"{name}_tiny" if args.tiny else name)).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return None
    return measure_hardware("cpu", 512, 2**22) if args.tiny else measure_hardware("cuda")


def summarise(result: dict, hardware: dict, why: str) -> dict:
    """Medians over the measured steps and calls; rates against the bounds (module docstring). A part
    the worker did not finish is reported with `why` it stopped."""
    model, preset = result["model"], result["preset"]
    word = 2 if preset["device"] == "cuda" else 4
    rate, bandwidth = hardware["matmul_flops_per_s"], hardware["copy_bytes_per_s"]
    summary = {"auto_engine": result["auto_engine"], "rollout_refusal": result["rollout_refusal"],
               "params": model["body_matmul_params"] + model["head_params"]}
    # both backends train on prompts x n sequences of P + R tokens
    sequences = preset["prompts"] * preset["n"]
    length = preset["prompt_length"] + preset["response_length"]
    flops = train_flops(model, [length] * sequences, [preset["response_length"]] * sequences)
    grpo = result.get("grpo", {"failed": why})
    if "steps" in grpo:
        measured = grpo["steps"]
        generation_s = statistics.median(step["phases_s"].get("generation", 0.0) for step in measured)
        train_s = statistics.median(step["phases_s"].get("train", 0.0) for step in measured)
        bound = decode_bound_s(model, sequences, preset["prompt_length"], preset["response_length"], word, bandwidth)
        summary.update(
            step_s=statistics.median(step["step_s"] for step in measured),
            decode_tokens_per_s=statistics.median(step["generated_tokens"] for step in measured) / generation_s,
            decode_bound_share=bound / generation_s, hf_train_mfu=flops / train_s / rate,
            peak_gib={phase: max(step["peak_gib"].get(phase, 0.0) for step in measured)
                      for phase in ("generation", "train")},
            grpo_steps=[{"step_s": step["step_s"], "events": step.get("events", {})} for step in measured])
    else:
        summary["grpo_error"] = grpo.get("refused") or grpo["failed"]
    megatron = result.get("megatron", {"failed": why})
    if "calls" in megatron:
        train_s = statistics.median(call["phases_s"]["train"] for call in megatron["calls"])
        summary["megatron_train_mfu"] = flops / train_s / rate
        summary["megatron_peak_gib"] = max(call["peak_gib"].get("train", 0.0) for call in megatron["calls"])
        summary["megatron_calls"] = [{"train_s": call["phases_s"]["train"], "events": call.get("events", {})}
                                     for call in megatron["calls"]]
    else:
        summary["megatron_error"] = megatron.get("refused") or megatron["failed"]
    return summary


def render(report: dict) -> str:
    """The markdown table of a report; a refusal or failure is a numbered note under it."""
    hardware, work = report["hardware"], report["workload"]
    lines = [
        f"Families ({report['date']}, {hardware['device_name']}; {hardware['matmul']} matrix rate "
        f"{hardware['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, copy {hardware['copy_bytes_per_s'] / 1e9:.0f} GB/s): "
        f"GRPO step of {work['prompts']} prompts x n={work['n']}, P={work['prompt_length']}, R={work['response_length']}, "
        f"HF backend, engine auto; the Megatron backend at TP=1 trains on the same shape of batch.",
        "",
        "| family | params | engine (auto) | decode tokens/s | decode bound | HF train MFU | Megatron train MFU "
        "| GRPO step s | peak GiB gen / train (HF) | Megatron peak GiB |",
        "| --- " * 10 + "|",
    ]
    notes: list[str] = []

    def note(text: str) -> str:
        notes.append(text)
        return f"[{len(notes)}]"

    for name, s in report["families"].items():
        if "failed" in s:
            lines.append(f"| {name} | failed {note(s['failed'])} |" + " - |" * 8)
            continue
        engine = s["auto_engine"] + (f" {note(s['rollout_refusal'])}" if s["rollout_refusal"] else "")
        if "step_s" in s:
            decode, bound, hf_mfu = (f"{s['decode_tokens_per_s']:,.0f}", f"{100 * s['decode_bound_share']:.1f}%",
                                     f"{100 * s['hf_train_mfu']:.1f}%")
            step, peaks = f"{s['step_s']:.2f}", f"{s['peak_gib']['generation']:.1f} / {s['peak_gib']['train']:.1f}"
        else:
            decode, (bound, hf_mfu, step, peaks) = f"not run {note(s['grpo_error'])}", ["-"] * 4
        if "megatron_train_mfu" in s:
            megatron, megatron_peak = f"{100 * s['megatron_train_mfu']:.1f}%", f"{s['megatron_peak_gib']:.1f}"
        else:
            megatron, megatron_peak = f"not run {note(s['megatron_error'])}", "-"
        params = f"{s['params'] / 1e9:.2f}B" if s["params"] >= 1e8 else f"{s['params'] / 1e6:.2f}M"
        cells = [params, engine, decode, bound, hf_mfu, megatron, step, peaks, megatron_peak]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [""] + [f"[{index}] {text}" for index, text in enumerate(notes, 1)]
    series = (("grpo_steps", "GRPO step", "step_s"), ("megatron_calls", "Megatron train", "train_s"))
    steps = [f"- {steps_line(f'{name} {label}', s[key], time)}" for name, s in report["families"].items()
             for key, label, time in series if key in s]
    if steps:
        lines += ["", "Every measured GRPO step and Megatron train call, seconds (* above 1.3x the median, with what "
                  "happened in it):", "", *steps]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from aligner_ext.models.family_configs import LAYOUTS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(LAYOUTS), help="comma-separated, from " + ", ".join(LAYOUTS))
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured GRPO steps first (compilation, graphs)")
    parser.add_argument("--steps", type=int, default=3, help="measured GRPO steps")
    parser.add_argument("--megatron-warmup", type=int, default=2, help="untimed Megatron train calls first")
    parser.add_argument("--megatron-steps", type=int, default=6, help="timed Megatron train calls (0: none, the "
                        "Megatron part skipped)")
    parser.add_argument("--torch-profile", default="", help="phases (comma-separated, e.g. train) of one more GRPO step "
                        "per family under torch.profiler: where their device time went, in <out>/<family>.torch_profile.txt")
    driver_arguments(parser, timeout=600)
    args = parser.parse_args(argv)
    hardware = driver_setup(args, "families")
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    report = {"date": datetime.date.today().isoformat(), "hardware": hardware,
              "workload": WORKLOADS["tiny" if args.tiny else "gpu"], "sizes": SIZES["tiny" if args.tiny else "gpu"],
              "command": " ".join(sys.argv[1:] if argv is None else argv), "families": {}}
    common = ["--out", str(args.out), "--warmup", str(args.warmup), "--steps", str(args.steps), "--lr", str(args.lr),
              "--megatron-warmup", str(args.megatron_warmup), "--megatron-steps", str(args.megatron_steps),
              "--torch-profile", args.torch_profile]
    for name in [family for family in args.families.split(",") if family]:
        command = [sys.executable, __file__, "--worker", name, *common, *(["--tiny"] if args.tiny else [])]
        left = min(args.timeout, args.budget - (time.perf_counter() - started))
        result, why = run_worker(name, command, args.out, left)
        if result is None and (args.out / f"{name}.json").exists():  # stopped after a part: report what it wrote
            result = json.loads((args.out / f"{name}.json").read_text())
        report["families"][name] = summarise(result, hardware, why) if result else {"failed": why}
        report["wall_s"] = time.perf_counter() - started
        write_json(args.out / "families.json", report)
        (args.out / "families.md").write_text(render(report) + "\n")
    print(render(report))


if __name__ == "__main__":
    main()
