"""The whole GRPO step, ours against TRL's GRPOTrainer, on identical work, against the hardware limits.

    python scripts/bench/run.py grpo --preset embedded --systems ours_rollout,trl_fast   # one GPU
    python scripts/bench/run.py grpo --preset tiny                                       # the 2-core CPU

One call runs, each in its own process and one after another (the device otherwise idle):
  1. the reference worker: writes the workspace (random-weight model from a config, tokenizer, prompt
     rows, log-prob probe), measures the matrix rate and the copy bandwidth, and the float32
     log-probs of the probe;
  2. every system of --systems (ours, ours_rollout with `generator.engine=rollout`, ours_rollout_prev
     its earlier settings, ours_liger with Liger-Kernel's training kernels, ours_packed training on
     packed micro-batches of 16384 tokens (ours_packed_carry also carrying 8 groups over,
     rollout.carry_over), ours_megatron the Megatron backend at TP=1 generating on
     its GPTModel and training on packed micro-batches (8192 tokens; ours_megatron_16k 16384),
     ours_megatron_distopt the same with activation recomputation and the distributed optimizer
     (OURS below): scripts/bench/grpo_step_ours.py; trl_default, trl_fast, trl_cb: scripts/bench/grpo_step_trl.py):
     `--warmup` steps, then `--steps` measured steps;
  3. every variant of --variants on our loop (`--variant-steps` measured steps each, with the engine
     of --variant-engine);
then prints and writes `grpo_step.md` and `grpo_step.json` under --out.

Asynchronous against synchronous in one call: `--asynchronous K` (or K1,K2) runs each of our systems
of --systems once more as NAME_async_kK, with `trainer.asynchronous.enabled=true
trainer.asynchronous.max_staleness=K` (generation ahead of training, docs/async.md), and the report
gives each against its synchronous run: samples/s, generation and training time, the trainer's wait
(its time in make_experience: making the batch, or waiting for the one made ahead), the generator's idle
time (synchronous: the rest of the step; asynchronous: the thread waiting for admission) and the
tokens' staleness. On two GPUs, `--disaggregated K` (or K1,K2) runs each of our systems twice more with
its engine in `aligner-ext serve` on the second GPU (SERVING_GPU) and training on the first, the weights
pushed over NCCL (grpo_step_ours.served_on): NAME_served, synchronous (each step generates through the
server, then trains, then pushes), and NAME_served_async_kK, generating ahead at max_staleness=K (the
disaggregated placement, docs/async.md), reported against NAME_served; NAME itself is the one-GPU
synchronous run. `--second-gpu K` runs each once more as NAME_gpu1_async_kK: generating ahead at
max_staleness=K in the trainer's process on the second GPU (`trainer.asynchronous.device`), reported against
NAME. A system named with its suffixes in --systems (NAME_async_kK, NAME_gpu1_async_kK) runs as that alone.
`--long-tail` makes the work long-tailed, for our systems: LONG_SHARE (10%) of each
step's responses run to R tokens, the others stop at R / 8 (the median), the long rows drawn by the
step's sampling seed (grpo_step_lib.LongTail); the bounds below count those lengths.

Memory: each step's peak allocated memory per phase; a system whose quietest peak rises at every step
after the first is named in the report with its rate (a run keeping something of each step fills the
device in time).

Before / after in one call: with `--prev COMMIT` (or a folder holding its tree), a system written
`prev:NAME` runs this harness's worker with the library of that tree (its `aligner_ext` and `conf/` first on
the path), on the same workspace and reference; the report then gives, per system with both sides,
the ratio after / before of the step and of each phase. `--torch-profile PHASES`: our systems run one
more step after the measured ones with those phases under torch.profiler (<out>/<system>.torch_profile.txt:
device time per phase, by kind of kernel, and the top kernels of each).

Identical work: the same weights and prompts (every prompt exactly P tokens; with
`--vary-prompt-widths` lengths drawn per step, the longest of each step other than the step before's,
up to P), n samples each,
every response exactly R tokens (EOS ignored; checked from each system's own counts), bf16
weights on the GPU (TRL's default mode keeps float32 weights under bf16 autocast, as it ships),
the same learning rate, constant schedule, KL off, one optimizer update per step. The benchmark
reward (grpo_step_lib.bench_score) costs next to nothing.

Formulas (stated in the report too), with W = bytes of the matrix weights (body + head, bf16 on the
GPU, float32 on the CPU; a mixture of experts' body counts each layer's expected distinct experts
chosen by B tokens, E * (1 - (1 - k/E)^B), in W and its top-k in `body`), k = K+V bytes per token,
B sequences, P prompt and R response tokens, `hidden` the query heads' width:
  decode bound       sum over t = 1..R of (W + B_t * (P + t) * k) / copy bandwidth, B_t the sequences still
                     decoding at step t (B; fewer on a long tail)
  share of it        decode bound / measured generation time (= generated tokens/s over the bound's)
  train FLOPs        per sequence 6 * body * (P + R) + 6 * head * R + 12 * L * hidden * (P + R)^2
  MFU                train FLOPs / train phase time / measured bf16 (CPU: float32) matrix rate
  step floor         decode bound + prefill (2 * body * P per distinct prompt + 4 * L * hidden * P^2)
                     / rate + (train FLOPs + one log-prob forward, a third of them) / rate
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from common import device_times, driver_version, prev_tree, steps_line  # noqa: E402
from grpo_step_lib import (LONG_FACTOR, LONG_SHARE, PRESETS, Preset, long_tail_lengths, write_json,  # noqa: E402
                           write_workspace)

SYSTEMS = ("ours", "ours_rollout", "ours_rollout_prev", "ours_liger", "ours_packed", "ours_megatron",
           "ours_megatron_16k", "ours_megatron_distopt", "trl_default", "trl_fast", "trl_cb")
# Our systems: the engine and the settings they add to the benchmark's overrides. ours_rollout_prev is
# the rollout engine as first measured (separate q/k/v and gate/up products, the old-log-prob pass
# always run): the "before" of later speed changes, in the same call. ours_liger trains with Liger-Kernel's
# fused norm / SwiGLU / RoPE (policy.kernels=liger; carry its wheel in .whl). ours_packed and the
# Megatron systems train on sequences packed under a token budget (policy.micro_batch_tokens).
OURS = {"ours": ("hf", []), "ours_rollout": ("rollout", []),
        "ours_rollout_prev": ("rollout", ["generator.rollout.fuse_projections=false", "policy.old_logprob_pass=always"]),
        "ours_liger": ("rollout", ["policy.kernels=liger"]),
        "ours_packed": ("rollout", ["policy.micro_batch_tokens=16384"]),
        "ours_packed_carry": ("rollout", ["policy.micro_batch_tokens=16384", "rollout.carry_over.groups=8"]),
        "ours_megatron": ("rollout", ["policy.backend=megatron", "policy.micro_batch_tokens=8192"]),
        "ours_megatron_16k": ("rollout", ["policy.backend=megatron", "policy.micro_batch_tokens=16384"]),
        "ours_megatron_distopt": ("rollout", ["policy.backend=megatron", "policy.micro_batch_tokens=8192",
                                              "policy.recompute_activations=true", "policy.use_distributed_optimizer=true"])}
VARIANTS = ("dapo", "cpo", "mtpo", "graded_prompt")
PREV_PREFIX = "prev:"  # a system run with the library of --prev (module docstring)
ASYNC_SUFFIX = "_async_k"  # NAME_async_kK: our system NAME generating ahead at max_staleness K (module docstring)
SECOND_GPU_SUFFIX = "_gpu1"  # NAME_gpu1_async_kK: the same, in the trainer's process on the second GPU
SERVED_SUFFIX = "_served"  # NAME_served[_async_kK]: our system NAME generating through a server on SERVING_GPU
SERVING_GPU = {"cuda": "1", "cpu": "cpu"}  # where --disaggregated serves, by the preset's device
DEVICE_OF_SECOND_GPU = {"cuda": "cuda:1", "cpu": "cpu"}  # where --second-gpu generates, by the preset's device
PHASES = ("generation", "logprobs", "train", "weight_sync", "rewards", "other")
GROWTH_GIB = 0.25  # a step's rise of allocated memory above which it counts as growth (the allocator's noise is less)


# ---------------------------------------------------------------- the reference worker

def measure_hardware(device: str, matmul_size: int | None = None, copy_elements: int | None = None) -> dict:
    """Matrix rate (bf16 8192^3 on a GPU, float32 2048^3 on the CPU, or `matmul_size`^3) and copy
    bandwidth (read + write of 2^28 float32 on a GPU, 2^26 on the CPU, or `copy_elements`)."""
    import torch

    def best_of(fn, repeats: int) -> float:
        return statistics.median(device_times(fn, repeats, device))

    size, dtype = (8192, torch.bfloat16) if device == "cuda" else (2048, torch.float32)
    size = matmul_size or size
    # a GPU's products and copies are timed 10 to a call (their launches queue), the median of 5 calls; on the
    # CPU one 2048^3 product takes a third of a second or more: one to a call, the median of 3 calls (with 10
    # x 5 each CPU run of a benchmark in the tests spent 15 s of both cores here)
    warmup, per_call, calls = (3, 10, 5) if device == "cuda" else (1, 1, 3)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    best_of(lambda: a @ b, warmup)
    matmul_s = best_of(lambda: [a @ b for _ in range(per_call)], calls) / per_call
    elements = copy_elements or (2**28 if device == "cuda" else 2**26)  # 1 GiB / 256 MiB of float32
    source = torch.randn(elements, device=device)
    target = torch.empty_like(source)
    best_of(lambda: target.copy_(source), warmup)
    copy_s = best_of(lambda: [target.copy_(source) for _ in range(per_call)], calls) / per_call
    info = {"matmul_flops_per_s": 2 * size**3 / matmul_s, "matmul": f"{size}^3 {dtype}".replace("torch.", ""),
            "copy_bytes_per_s": 2 * source.numel() * source.element_size() / copy_s}
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
        info["driver"] = driver_version()
    else:
        info["device_name"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return info


def reference_logprobs(workspace: Path, device: str):
    """Log-probs of the probe responses under float32 weights, log-softmax in float64."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32).to(device).eval()
    probe = torch.load(workspace / "probe.pt")
    prompt_width = probe["prompt_ids"].shape[1]
    ids = torch.cat([probe["prompt_ids"], probe["response_ids"]], dim=1).to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, prompt_width - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt_width:, None]).squeeze(-1).cpu()


def reference_worker(args) -> None:
    import torch

    preset = PRESETS[args.preset]
    rows_needed = preset.prompts * (args.warmup + max(args.steps, args.variant_steps)) * 3  # dynamic sampling's refills
    started = time.perf_counter()
    counts = write_workspace(preset, rows_needed, args.out / "work", vary_widths=args.vary_prompt_widths)
    workspace_s = time.perf_counter() - started
    torch.save(reference_logprobs(args.out / "work", preset.device), args.out / "reference.probe.pt")
    write_json(args.out / "reference.json", {**measure_hardware(preset.device), "model": counts,
                                             "workspace_s": workspace_s})


# ---------------------------------------------------------------- the driver

def run_worker(name: str, command: list[str], out: Path, timeout: float, root: Path = ROOT) -> tuple[dict | None, str]:
    """Run one worker in its own process (and process group): (its result JSON, "") or (None, why not).
    `root`: the tree whose library the worker imports (an earlier checkout's for a before / after)."""
    if timeout < 30:
        print(f"== {name}: skipped, {timeout:.0f} s of the budget left", flush=True)
        return None, "skipped: the call's --budget was spent"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
    print(f"== {name}: {' '.join(command)}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = f"timeout after {timeout:.0f} s"
    result = out / f"{name}.json"
    if code != 0 and isinstance(code, str) and result.exists():  # its results were written before the limit
        print(f"   {name}: {code}, after writing its results (kept)", flush=True)
        return json.loads(result.read_text()), f"{code}: stopped after writing what it had"
    if code != 0 or not result.exists():
        tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
        print(f"   {name} failed ({code}):\n     " + "\n     ".join(tail), flush=True)
        return None, f"exit {code}, see {name}.log"
    print(f"   {name} done", flush=True)
    return json.loads(result.read_text()), ""


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def floors(preset: Preset, hardware: dict, lengths: list[int] | None = None) -> dict:
    """The physical floor of one step of `preset` on the measured hardware (module docstring);
    `lengths`: each sequence's response length (default: R each)."""
    model = hardware["model"]
    word = 2 if preset.device == "cuda" else 4
    sequences, prompt = preset.prompts * preset.n, preset.prompt_length
    lengths = lengths or [preset.response_length] * sequences
    weights = model["body_matmul_params"] + model["head_params"]
    if "experts" in model:  # a decode step reads every expert one of its tokens chooses, not only top-k
        experts, top_k = model["experts"], model["top_k"]
        chosen = experts * (1 - (1 - top_k / experts) ** sequences)  # distinct experts per layer, routing uniform
        weights += model["layers"] * model["expert_params"] * (chosen - top_k)
    weight_bytes = weights * word
    kv_bytes = model["kv_values_per_token"] * word
    # sum over the sequences of P + t over each one's decoding steps; the weights are read at every step
    contexts = sum(response * prompt + response * (response + 1) // 2 for response in lengths)
    decode_s = (max(lengths) * weight_bytes + kv_bytes * contexts) / hardware["copy_bytes_per_s"]
    layers_hidden = model["layers"] * model.get("q_width", model["hidden"])  # query heads x head_dim
    train_flops = sum(6 * model["body_matmul_params"] * (prompt + response) + 6 * model["head_params"] * response
                      + 12 * layers_hidden * (prompt + response)**2 for response in lengths)
    prefill_flops = preset.prompts * (2 * model["body_matmul_params"] * prompt + 4 * layers_hidden * prompt**2)
    rate = hardware["matmul_flops_per_s"]
    return {"decode_bound_s": decode_s, "prefill_floor_s": prefill_flops / rate, "train_flops": train_flops,
            "train_floor_s": train_flops / rate, "logprob_floor_s": train_flops / 3 / rate,
            "step_floor_s": decode_s + prefill_flops / rate + train_flops * 4 / 3 / rate,
            "generated_tokens": sum(lengths)}


def relative_error(values, reference) -> dict:
    values, reference = values.double(), reference.double()
    return {"relative_l2": float((values - reference).norm() / reference.norm()),
            "max_abs": float((values - reference).abs().max())}


def summarise(result: dict, preset: Preset, floor: dict, hardware: dict) -> dict:
    """Medians over the measured steps, the response-length check, rates against the bounds, the first step."""
    measured = result["steps"][result["warmup_steps"]:]
    step_s = median_range([step["step_s"] for step in measured])
    phases = {phase: statistics.median(step["phases_s"].get(phase, 0.0) for step in measured) for phase in PHASES}
    peaks = {phase: max(step["peak_gib"].get(phase, 0.0) for step in measured) for phase in PHASES}
    sequences = preset.prompts * preset.n
    if result["system"].removeprefix(PREV_PREFIX).startswith("ours"):
        calls = [call for step in measured for call in step["generate_calls"]]
        lengths = (min(c["min_length"] for c in calls), max(c["max_length"] for c in calls))
        generated = statistics.median(sum(c["tokens"] for c in step["generate_calls"]) for step in measured)
        trained_tokens = [step["trained_tokens"] / max(step["trained_sequences"], 1) for step in measured]
    else:
        lengths = (int(min(step["metrics"]["completions/min_length"] for step in measured)),
                   int(max(step["metrics"]["completions/max_length"] for step in measured)))
        generated = statistics.median(step["metrics"]["completions/mean_length"] * sequences for step in measured)
        seen = [step["metrics"]["num_tokens"] for step in result["steps"]]  # TRL's running count of trained tokens
        trained_tokens = [(later - earlier) / sequences for earlier, later in zip(seen, seen[1:])]
    ahead = "async/trainer_wait_s" in measured[0]["metrics"]  # generated in the maker's thread, not on the clock
    generation_s = statistics.median(step["generation_s"] for step in measured) if ahead else phases["generation"]
    first = result["steps"][0]
    summary = {
        "step_s": step_s, "phases_s": phases, "peak_gib": peaks, "response_lengths": lengths,
        "tokens_per_sequence": (min(trained_tokens), max(trained_tokens)),  # P + R as the trainer saw it
        "generated_tokens": generated, "generated_tokens_per_s": generated / generation_s if generation_s else None,
        "startup_s": result["startup_s"], "first_step_s": first["step_s"], "first_step_done_at_s": first["ended_at_s"],
        "first_step_phases_s": first["phases_s"], "settings": result["settings"],
        "steps": [{"step_s": step["step_s"], "phases_s": step["phases_s"], "events": step.get("events", {})}
                  for step in measured],
        "baseline_gib": baseline_memory(result["steps"]),
    }
    if result["system"].removeprefix(PREV_PREFIX).startswith("ours"):
        summary["overlap"] = overlap(measured, sequences, ahead)
        if ahead:  # the run it is compared with
            summary["overlap"]["synchronous"] = result["system"].rsplit(ASYNC_SUFFIX, 1)[0].removesuffix(SECOND_GPU_SUFFIX)
    if result["variant"] == "none":
        summary["decode_bound_share"] = floor["decode_bound_s"] / generation_s
        summary["train_mfu"] = floor["train_flops"] / phases["train"] / hardware["matmul_flops_per_s"]
        summary["step_over_floor"] = step_s[0] / floor["step_floor_s"]
    return summary


def overlap(measured: list[dict], sequences: int, ahead: bool) -> dict:
    """Medians over our measured steps of what generation ahead changes (module docstring): samples/s,
    generation s (the engine calls making the step's batch), train s, the trainer's wait, the generator's
    idle time; and the tokens' staleness, their mean, max, share at each lag and the engine/trainer
    log-prob gap at each lag (averaged over steps; at lag 0 the engines' numerics alone)."""
    def median(values) -> float:
        return statistics.median(list(values))

    def by_lag(prefix: str, absent: float | None) -> dict[str, float]:
        """Lag -> the mean over the steps of metric `prefix`<lag>, counting `absent` where a step has no
        token at that lag (None: leaving that step out)."""
        keys = sorted({key for step in measured for key in step["metrics"] if key.startswith(prefix)},
                      key=lambda key: int(key.removeprefix(prefix)))
        return {key.removeprefix(prefix): statistics.fmean(value for step in measured if (
            value := step["metrics"].get(key, absent)) is not None) for key in keys}

    step_s = median(step["step_s"] for step in measured)
    idle = (median(step["metrics"]["async/generator_idle_s"] for step in measured) if ahead
            else median(step["step_s"] - step["trainer_wait_s"] for step in measured))
    staleness = {"mean": statistics.fmean(step["metrics"].get("staleness/mean", 0.0) for step in measured),
                 "max": max(step["metrics"].get("staleness/max", 0.0) for step in measured),
                 "share_by_lag": by_lag("staleness/share_lag_", 0.0),
                 "logprob_gap_by_lag": by_lag("rollout/logprob_diff_mean_lag_", None)}
    return {"asynchronous": ahead, "samples_per_s": sequences / step_s, "step_s": step_s,
            # on a long tail steps differ by their long prompts: the rate over the run, and the responses' length
            "samples_per_s_over_run": sequences * len(measured) / sum(step["step_s"] for step in measured),
            "response_length_mean": statistics.fmean(step["metrics"]["response/length_mean"] for step in measured),
            "generation_s": median(step["generation_s"] for step in measured),
            "train_s": median(step["phases_s"].get("train", 0.0) for step in measured),
            "trainer_wait_s": median(step["trainer_wait_s"] for step in measured), "generator_idle_s": idle,
            "staleness": staleness}


def baseline_memory(steps: list[dict]) -> list[float]:
    """Each step's quietest peak of allocated memory (the least over its phases; none on the CPU): what
    stays allocated from step to step, which a run that keeps nothing of a step holds flat."""
    return [min(step["peak_gib"].values()) for step in steps if step.get("peak_gib")]


def memory_growth_lines(systems: dict) -> list[str]:
    """A line per system whose memory grew at every step after the first (something each step left
    allocated: a run at the same rate fills the device in time), with the rate."""
    lines = []
    for name, s in systems.items():
        baseline = s.get("baseline_gib", [])[1:]  # step 0 compiles and allocates the run's state
        rises = [later - earlier for earlier, later in zip(baseline, baseline[1:])]
        if len(rises) >= 2 and min(rises) > GROWTH_GIB:
            lines.append(f"- {name}: the allocated memory grew at every step, {sum(rises) / len(rises):.2f} GiB a "
                         f"step ({baseline[0]:.1f} to {baseline[-1]:.1f} GiB at each step's quietest phase): each "
                         "step leaves something allocated")
    return ["", "Memory that grew at every step:", "", *lines] if lines else []


def overlap_lines(systems: dict) -> list[str]:
    """Each asynchronous system (NAME_async_kK) against its synchronous NAME: values, and their ratio to
    the synchronous run's in brackets."""
    pairs = [(name, s["overlap"]["synchronous"]) for name, s in systems.items()
             if s.get("overlap", {}).get("synchronous") in systems]
    if not pairs:
        return []
    lines = ["", "Asynchronous against synchronous (medians over the measured steps; in brackets, over the synchronous "
             "run's): trainer wait = its time in make_experience, making the batch or waiting for it; generator idle ="
             " synchronous, the rest of the step; asynchronous, the thread waiting for admission. Staleness: versions "
             "behind the proximal policy per sampled token, mean / max, share of tokens at each lag; the engine/trainer "
             "log-prob gap at each lag (lag 0: the engines' numerics alone, as in the synchronous run).", "",
             "| system | samples/s | step s | generation s | train s | trainer wait s | generator idle s "
             "| staleness mean / max | tokens per lag | log-prob gap per lag |", "| --- " * 10 + "|"]
    synchronous_runs = [(synchronous, None) for synchronous in dict.fromkeys(synchronous for _, synchronous in pairs)]
    for name, synchronous in synchronous_runs + pairs:
        o = systems[name]["overlap"]
        base = systems[synchronous]["overlap"] if synchronous else None

        def cell(key: str, digits: int = 2) -> str:
            ratio = f" ({o[key] / base[key]:.2f}x)" if base and base[key] > 1e-9 else ""
            return f"{o[key]:.{digits}f}{ratio}"

        stale = o["staleness"]
        lags = ", ".join(f"{lag}: {100 * share:.0f}%" for lag, share in stale["share_by_lag"].items()) or "-"
        gaps = ", ".join(f"{lag}: {gap:.4f}" for lag, gap in stale["logprob_gap_by_lag"].items()) or "-"
        lines.append(f"| {name} | {cell('samples_per_s', 1)} | {cell('step_s')} | {cell('generation_s')} "
                     f"| {cell('train_s')} | {cell('trainer_wait_s')} | {cell('generator_idle_s')} "
                     f"| {stale['mean']:.2f} / {stale['max']:.0f} | {lags} | {gaps} |")
    return lines


def render(report: dict) -> str:
    """The markdown tables of a report."""
    preset, hardware, floor = report["preset"], report["hardware"], report["floor"]
    systems = report["systems"]
    ours = systems.get("ours")
    lines = [
        f"GRPO step, preset `{preset['name']}` ({report['date']}, {hardware['device_name']}): "
        f"{preset['prompts']} prompts x n={preset['n']}, P={preset['prompt_length']}"
        f"{' (the longest; widths vary every step)' if report.get('vary_prompt_widths') else ''}, "
        f"R={preset['response_length']}"
        + (f" (long-tailed: {report['long_tail']['share']:.0%} of the "
           f"{'prompts (all their responses)' if report['long_tail'].get('by_prompt') else 'responses'} R tokens, the others "
           f"R / {report['long_tail']['factor']})" if report.get("long_tail") else "") + "; "
        f"{hardware['matmul']} matrix rate {hardware['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, "
        f"copy {hardware['copy_bytes_per_s'] / 1e9:.0f} GB/s; step floor {floor['step_floor_s']:.3f} s "
        f"(decode bound {floor['decode_bound_s']:.3f} s, prefill {floor['prefill_floor_s']:.3f} s, "
        f"train {floor['train_floor_s']:.3f} s, log-prob forward {floor['logprob_floor_s']:.3f} s).",
        "",
        "| system | step s, median [min, max] | vs ours | generation s | log-probs s | train s | weight sync s "
        "| rewards s | other s | gen tokens/s | decode bound | train MFU | x floor | peak GiB gen / train "
        "| response lengths | P + R trained | first step s (done at) |",
        "| --- " * 17 + "|",
    ]
    for name, s in systems.items():
        ratio = f"{s['step_s'][0] / ours['step_s'][0]:.2f}x" if ours else "-"
        p = s["phases_s"]
        lines.append(
            f"| {name} | {s['step_s'][0]:.2f} [{s['step_s'][1]:.2f}, {s['step_s'][2]:.2f}] | {ratio} "
            f"| {generation_cell(s)} | {p['logprobs']:.2f} | {p['train']:.2f} | {p['weight_sync']:.3f} "
            f"| {p['rewards']:.3f} | {p['other']:.2f} | {s['generated_tokens_per_s']:,.0f} "
            f"| {100 * s['decode_bound_share']:.1f}% | {100 * s['train_mfu']:.1f}% | {s['step_over_floor']:.1f} "
            f"| {s['peak_gib']['generation']:.1f} / {s['peak_gib']['train']:.1f} "
            f"| {s['response_lengths'][0]}-{s['response_lengths'][1]} "
            f"| {s['tokens_per_sequence'][0]:.0f}-{s['tokens_per_sequence'][1]:.0f} "
            f"| {s['first_step_s']:.1f} ({s['first_step_done_at_s']:.1f}) |")
    lines += ["", "Step-0 log-probs of the probe (4 x R tokens) against float32 weights with a float64 log-softmax:", ""]
    lines += [f"- {name}: relative L2 {e['relative_l2']:.2e}, max abs {e['max_abs']:.3f}"
              for name, e in report["logprob_check"].items()]
    if report["variants"]:
        lines += ["", f"| variant (ours, engine {report.get('variant_engine', 'hf')}) | step s, median [min, max] "
                  "| vs plain GRPO | generation s | log-probs s | train s | rewards s | generated tokens | what the variant adds |", "| --- " * 9 + "|"]
        plain = systems.get("ours" if report.get("variant_engine", "hf") == "hf" else "ours_rollout")
        for name, s in report["variants"].items():
            ratio = f"{s['step_s'][0] / plain['step_s'][0]:.2f}x" if plain else "-"
            p = s["phases_s"]
            lines.append(f"| {name} | {s['step_s'][0]:.2f} [{s['step_s'][1]:.2f}, {s['step_s'][2]:.2f}] | {ratio} "
                         f"| {p['generation']:.2f} | {p['logprobs']:.2f} | {p['train']:.2f} | {p['rewards']:.3f} "
                         f"| {s['generated_tokens']:,.0f} | {s['note']} |")
    lines += ["", "Every measured step, seconds (* above 1.3x the median, with what happened in it):", ""]
    lines += [f"- {steps_line(name, s['steps'])}" for name, s in {**systems, **report["variants"]}.items()]
    lines += memory_growth_lines(systems)
    lines += ratio_lines(systems)
    lines += overlap_lines(systems)
    for name, error in report["failures"].items():
        lines.append(f"\n{name} did not finish: {error}")
    return "\n".join(lines)


def generation_cell(s: dict) -> str:
    """The generation time of a system's step: on the clock, or (generated ahead) in the maker's thread."""
    if s.get("overlap", {}).get("asynchronous"):
        return f"{s['overlap']['generation_s']:.2f} (ahead)"
    return f"{s['phases_s']['generation']:.2f}"


def ratio_lines(systems: dict) -> list[str]:
    """After / before of the step and of each phase, for every system run from both trees (`prev:`)."""
    pairs = [(name, systems[PREV_PREFIX + name]) for name in systems
             if not name.startswith(PREV_PREFIX) and PREV_PREFIX + name in systems]
    if not pairs:
        return []
    lines = ["", "After / before (this tree over `--prev`'s, medians; below 1 is faster):", "",
             "| system | step | " + " | ".join(PHASES) + " | peak GiB train |", "| --- " * (len(PHASES) + 3) + "|"]
    for name, before in pairs:
        after = systems[name]

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.3f}" if b > 1e-4 else "-"

        cells = [ratio(after["step_s"][0], before["step_s"][0])]
        cells += [ratio(after["phases_s"][phase], before["phases_s"][phase]) for phase in PHASES]
        cells.append(ratio(after["peak_gib"]["train"], before["peak_gib"]["train"]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def variant_note(name: str, result: dict) -> str:
    measured = result["steps"][result["warmup_steps"]:]

    def mean(key):
        values = [step["metrics"][key] for step in measured if key in step["metrics"]]
        return sum(values) / len(values) if values else float("nan")

    if name == "dapo":
        return (f"{mean('dynamic_sampling/num_gen_batches'):.1f} generation batches per step, "
                f"{100 * mean('dynamic_sampling/filtered_fraction'):.0f}% of groups filtered")
    if name == "mtpo":
        return (f"round 2 / round 1 time {mean('mtpo/round2_time_ratio'):.2f}; "
                f"rounds {mean('timing/mtpo_round1_s'):.2f} s + {mean('timing/mtpo_round2_s'):.2f} s")
    if name == "cpo":
        return "hinted log-prob pass (in log-probs)"
    if name == "graded_prompt":
        return "per-sample rubric system prompts (longer prefill)"
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from " + ", ".join(SYSTEMS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (empty: none), from "
                        + ", ".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per system")
    parser.add_argument("--variant-steps", type=int, default=None, help="measured steps per variant (preset's)")
    parser.add_argument("--variant-engine", default="hf", choices=("hf", "rollout"), help="generator.engine of the variant runs")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--eos", action="store_true", help="our systems' responses end at EOS, as in training: "
                        "lengths and so shapes vary from step to step (the bound and MFU columns still count R tokens)")
    parser.add_argument("--long-tail", action="store_true", help=f"our systems' responses are long-tailed: "
                        f"{LONG_SHARE:.0%}% of them R tokens, the others R / {LONG_FACTOR} (module docstring)")
    parser.add_argument("--long-tail-by-prompt", action="store_true", help="as --long-tail, each prompt long with "
                        "probability LONG_SHARE, all its responses then R tokens: a long response keeps its length "
                        "when carried over to a later step (rollout.carry_over; grpo_step_lib.LongTailByPrompt)")
    parser.add_argument("--set", action="append", default=[], help="one more config override for our systems "
                        "(repeatable), e.g. generator.rollout.cuda_graphs=false")
    parser.add_argument("--asynchronous", type=staleness_bounds, default=[], help="K or K1,K2: each of our systems also runs generating "
                        "ahead of training at trainer.asynchronous.max_staleness=K, as NAME_async_kK")
    parser.add_argument("--partial-rollouts", action="store_true", help="with --asynchronous: the runs generating "
                        "ahead park and resume their unfinished responses at each refit (trainer.asynchronous.partial_rollouts)")
    parser.add_argument("--disaggregated", type=staleness_bounds, default=[], help="K or K1,K2: each of our systems "
                        "also runs generating through `aligner-ext serve` on the second GPU, synchronous (NAME_served) "
                        "and ahead of training at max_staleness=K (NAME_served_async_kK)")
    parser.add_argument("--second-gpu", type=staleness_bounds, default=[], help="K or K1,K2: each of our systems also "
                        "runs generating ahead at max_staleness=K in the trainer's process on the second GPU "
                        "(trainer.asynchronous.device; NAME_gpu1_async_kK)")
    parser.add_argument("--vary-prompt-widths", action="store_true", help="prompts of lengths drawn per step "
                        "(seeded; grpo_step_lib.varying_prompt_lengths): every step's prompt width differs from the "
                        "step before's, as with real data (the bound and MFU columns still count P tokens)")
    parser.add_argument("--profile-first-step", action="store_true",
                        help="our systems run their first step under cProfile (<out>/<system>.first_step_profile.txt)")
    parser.add_argument("--profile-slow-steps", action="store_true", help="our systems run every measured step under "
                        "cProfile and keep the profiles of those above 1.3x the median (<out>/<system>.step<K>_profile.txt)")
    parser.add_argument("--torch-profile", default="", help="phases (comma-separated, e.g. train,logprobs) of one more "
                        "step of our systems (this tree's) to run under torch.profiler (<out>/<system>.torch_profile.txt)")
    parser.add_argument("--prev", type=prev_tree, default=None,
                        help="an earlier commit or its tree: systems written prev:NAME run with its library")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per worker process")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds for the whole call: a worker gets at most what is left, and the report is "
                             "rewritten after every worker, so a device call's time limit loses no finished result")
    parser.add_argument("--out", type=Path, default=None, help="default: bench_out/grpo_step_<preset>")
    parser.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.long_tail and args.long_tail_by_prompt:
        parser.error("--long-tail and --long-tail-by-prompt are two workloads: choose one")
    long_tail = args.long_tail or args.long_tail_by_prompt
    if long_tail and args.eos:
        parser.error("--long-tail sets each response's length; --eos lets EOS end them: choose one")
    if long_tail and (args.variants or any(not s.removeprefix(PREV_PREFIX).startswith("ours")
                                                for s in args.systems.split(",") if s)):
        parser.error("--long-tail is our plain GRPO step's workload: pass --variants '' and only ours* systems")
    preset = PRESETS[args.preset]
    args.variant_steps = args.variant_steps or preset.variant_steps
    args.out = (args.out or ROOT / "bench_out" / f"grpo_step_{args.preset}").resolve()
    if args.reference_worker:
        return reference_worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def left() -> float:
        return min(args.timeout, args.budget - (time.perf_counter() - started) - 15)

    common = ["--workspace", str(args.out / "work"), "--warmup", str(args.warmup), "--lr", str(args.lr)]
    if run_worker("reference", [sys.executable, __file__, "--reference-worker", "--preset", args.preset,
                                "--out", str(args.out), "--steps", str(args.steps),
                                "--variant-steps", str(args.variant_steps)]
                  + ["--vary-prompt-widths"] * args.vary_prompt_widths, args.out, left())[0] is None:
        sys.exit("the reference worker failed: nothing to compare against")
    hardware = json.loads((args.out / "reference.json").read_text())
    lengths = long_tail_lengths(preset.prompts * preset.n, preset.response_length) if long_tail else None  # by prompt: on average
    floor = floors(preset, hardware, lengths)
    import torch

    reference = torch.load(args.out / "reference.probe.pt")
    report = {"preset": preset.__dict__, "hardware": hardware, "floor": floor, "systems": {}, "variants": {},
              "logprob_check": {}, "failures": {}, "variant_engine": args.variant_engine,
              "long_tail": {"share": LONG_SHARE, "factor": LONG_FACTOR, "by_prompt": args.long_tail_by_prompt}
              if long_tail else None,
              "vary_prompt_widths": args.vary_prompt_widths,
              "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv[1:] if argv is None else argv)}
    systems = []
    for system in [s for s in args.systems.split(",") if s]:
        systems += with_ahead_runs(system, args.asynchronous, args.disaggregated, args.second_gpu)
    for system in systems:
        base, root = system.removeprefix(PREV_PREFIX), ROOT
        if base != system:
            if args.prev is None:
                sys.exit(f"{system}: name the earlier tree with --prev")
            root = args.prev
        if base.startswith("ours"):
            base, _, staleness = base.partition(ASYNC_SUFFIX)
            served, second_gpu = base.endswith(SERVED_SUFFIX), base.endswith(SECOND_GPU_SUFFIX)
            engine, settings = OURS[base.removesuffix(SERVED_SUFFIX).removesuffix(SECOND_GPU_SUFFIX)]
            if staleness:
                settings = [*settings, "trainer.asynchronous.enabled=true",
                            f"trainer.asynchronous.max_staleness={staleness}",
                            *(["trainer.asynchronous.partial_rollouts=true"] if args.partial_rollouts else []),
                            *([f"trainer.asynchronous.device={DEVICE_OF_SECOND_GPU[preset.device]}"] if second_gpu else [])]
            script, extra = "grpo_step_ours.py", ["--engine", engine, "--system", system,
                                                  *[arg for setting in [*settings, *args.set] for arg in ("--set", setting)]]
            extra += ["--serve-on", SERVING_GPU[preset.device]] if served else []
            extra += ["--profile-first-step"] if args.profile_first_step else []
            extra += ["--profile-slow-steps"] if args.profile_slow_steps and base == system else []
            extra += ["--eos"] if args.eos else []
            extra += ["--long-tail"] if args.long_tail else []
            extra += ["--long-tail-by-prompt"] if args.long_tail_by_prompt else []
            extra += ["--torch-profile", args.torch_profile] if args.torch_profile and base == system else []  # this tree's side
        else:
            script, extra = "grpo_step_trl.py", ["--mode", base.removeprefix("trl_")]
        stem = system.replace(":", "_")  # file names without the colon
        result, why = run_worker(stem, [sys.executable, str(HERE / script), *common, *extra, "--steps", str(args.steps),
                                        "--out", str(args.out / f"{stem}.json")], args.out, left(), root)
        if result is None:
            report["failures"][system] = why
        else:
            report["systems"][system] = summarise(result, preset, floor, hardware)
            report["logprob_check"][system] = relative_error(torch.load(args.out / f"{stem}.probe.pt"), reference)
        write_report(report, args.out, started)
    for variant in [v for v in args.variants.split(",") if v]:
        name = f"ours_{variant}" if args.variant_engine == "hf" else f"ours_{args.variant_engine}_{variant}"
        result, why = run_worker(name, [sys.executable, str(HERE / "grpo_step_ours.py"), *common, "--variant", variant,
                                        "--engine", args.variant_engine,
                                   "--steps", str(args.variant_steps), "--out", str(args.out / f"{name}.json")],
                            args.out, left())
        if result is None:
            report["failures"][name] = why
        else:
            report["variants"][variant] = {**summarise(result, preset, floor, hardware),
                                           "note": variant_note(variant, result)}
        write_report(report, args.out, started)
    print(write_report(report, args.out, started))


def with_ahead_runs(system: str, asynchronous: list[int], disaggregated: list[int], second_gpu: list[int]) -> list[str]:
    """`system` and, for one of ours (this tree's: generation ahead is this tree's) named without a suffix, its
    runs generating ahead at each bound of --asynchronous, through a server, synchronous then at each bound of
    --disaggregated, and on the second GPU at each bound of --second-gpu."""
    if not system.startswith("ours") or ASYNC_SUFFIX in system:
        return [system]
    served = [f"{system}{SERVED_SUFFIX}"] + [f"{system}{SERVED_SUFFIX}{ASYNC_SUFFIX}{k}" for k in disaggregated]
    return [system, *[f"{system}{ASYNC_SUFFIX}{k}" for k in asynchronous], *(served if disaggregated else []),
            *[f"{system}{SECOND_GPU_SUFFIX}{ASYNC_SUFFIX}{k}" for k in second_gpu]]


def staleness_bounds(text: str) -> list[int]:
    """--asynchronous: K or K1,K2 (trainer.asynchronous.max_staleness of each run)."""
    return [int(k) for k in text.split(",") if k]


def write_report(report: dict, out: Path, started: float, name: str = "grpo_step", markdown=None) -> str:
    """<name>.json and <name>.md (`markdown(report)`, default `render`) as they stand; returns the markdown."""
    report["wall_s"] = time.perf_counter() - started
    write_json(out / f"{name}.json", report)
    table = (markdown or render)(report)
    (out / f"{name}.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
