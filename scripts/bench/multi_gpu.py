"""The multi-GPU table (`run.py multi-gpu`): `aligner-ext train` on the Megatron backend with the rollout
engine, under torchrun, one run per row of multi_gpu_rows.py, every row of a machine kind in one call.

    python scripts/bench/run.py multi-gpu --rows table-2gpu          # two GPUs (table-4gpu: four)
    python scripts/bench/run.py multi-gpu --rows 8b-tp2-sp,8b-pp2     # rows by name
    python scripts/bench/run.py multi-gpu --rows table-cpu            # the CPU, 2 processes, gloo (tests/bench)

Per shape, once: a random-weight checkpoint of the family's config class at the shape's dimensions (bf16,
a word tokenizer of its vocabulary) and the GRPO benchmark's rows (grpo_step_lib.write_workspace: prompts of
P tokens, a score for every variant). Per row: a run of `row.steps` steps at its layout; each variant for
`row.variant_steps` steps at the same layout; the final checkpoint resumed at `row.resume` for one more
step. Each process writes its peak memory (multi_gpu_rank.py). A row needing more GPUs than the machine has
(on the CPU: --processes) is skipped with a line; a run that fails gives the line it failed with (the
library's own, e.g. a checkpoint that will not fit in the free disk space, trainer/disk_space.py). A row's
checkpoints are deleted once it is done, a shape's checkpoint after its last row (an 8B checkpoint with the
optimizer's state is ~105 GB; the machines have 128-235 GiB).

Per run, from metrics.jsonl (steps after the first, which compiles): the step time (median, range),
samples per second, the generation (rollout stage: generation and rewards) and training (policy.train)
seconds, training MFU (families.train_flops of the step's sequences over the train time and the measured
matrix rate of each GPU, x the processes), peak GiB of every rank, the final checkpoint's bytes and write
time and the stall of each background save (save_stall.summarise: the checkpointer's "the loop waited"
line plus the next step's excess over the median), and the engine's log-probs against the trainer's
(`rollout/logprob_diff_mean`, median over the steps: a trainer forward or an engine that computes another
model than the other shows there, which no timing does). Writes multi_gpu.json and multi_gpu.md under --out,
rewritten after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ROOT  # noqa: E402
from families import shape as model_shape  # noqa: E402
from families import train_flops  # noqa: E402
from grpo_step_lib import LONG_FACTOR, LONG_SHARE, Preset, write_json  # noqa: E402
from grpo_step_ours import overrides as workload_overrides  # noqa: E402
from multi_gpu_rows import (GPU_PROMPT, GPU_RESPONSE, SHAPES, TINY_PROMPT, TINY_RESPONSE, Layout, Row,  # noqa: E402
                            named_rows)
from save_stall import summarise as save_summary  # noqa: E402

USER_ERROR = re.compile(r"aligner-ext: (?:config )?error: .*")  # the CLI's one line (aligner_ext/cli.py)
# a traceback's last line (torchrun's own ChildFailedError, which follows any worker's, says nothing more)
RAISED = re.compile(r"^(?:\[rank\d+\]: )?((?:\w+\.)*(?!ChildFailedError)\w+(?:Error|Exception): .*)$", re.M)
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")
ROW_LEAST_S = 90  # a row starts only with this much of --budget left: its checkpoint is built and loaded first


def prepare(name: str, rows_needed: int, work: Path, device: str) -> tuple[Preset, dict]:
    """The shape's workspace under `work/name` and its Preset; the model's counts (families.shape)."""
    import torch
    from grpo_step_lib import build_word_tokenizer, write_workspace
    from transformers import AutoModelForCausalLM

    from aligner_ext.models.family_configs import family_config

    family, sizes = SHAPES[name]
    config = family_config(family, **sizes)
    tiny = name.startswith("tiny")
    preset = Preset(name, "words", config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                    config.num_key_value_heads, getattr(config, "intermediate_size", 0), config.vocab_size,
                    prompts=1, n=1, prompt_length=TINY_PROMPT if tiny else GPU_PROMPT,
                    response_length=TINY_RESPONSE if tiny else GPU_RESPONSE, micro_batch=1, device=device,
                    variant_steps=1)
    torch.manual_seed(0)
    with torch.device(device):  # random initialisation on the GPU: minutes on the host at 8B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    write_workspace(preset, rows_needed, work / name, model_and_tokenizer=(model, build_word_tokenizer(config.vocab_size)))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return preset, model_shape(config)


def settings(row: Row, layout: Layout, preset: Preset, workspace: Path, run_name: str, steps: int,
             variant: str = "none", extra: dict | None = None) -> list[str]:
    """The GRPO benchmark's workload overrides (rollout engine) at the row's batch, on the Megatron backend
    at `layout`, as a fresh run of `steps` steps that checkpoints as the row asks; `extra` on top."""
    batch = replace(preset, prompts=row.prompts, n=row.n, micro_batch=row.micro_batch)
    mine = {"policy.backend": "megatron", "policy.micro_batch_tokens": row.micro_batch_tokens,
            "trainer.run_name": run_name, "trainer.total_steps": steps, "trainer.save_every": row.save_every,
            "trainer.async_save": "true", "trainer.save_optimizer": str(row.save).lower(), "trainer.keep_last": 1,
            "trainer.export_hf": "false", "trainer.log_samples_every": 0, "trainer.resume": "false",
            **({"reward.num_workers": 1} if row.tiny else {}), **(extra or {})}  # a process less per rank on the CPU
    given = workload_overrides(batch, workspace, variant, 1e-6, "rollout") + layout.overrides()
    return [o for o in given if o.split("=", 1)[0] not in mine] + [f"{key}={value}" for key, value in mine.items()]


def launch(name: str, processes: int, overrides: list[str], out: Path, args,
           long_tail: str = "") -> tuple[int | str, str, dict]:
    """One `aligner-ext train` under torchrun: its exit status (or why none), its output (out/<name>.log) and
    every rank's peak memory (multi_gpu_rank.py); `long_tail`: the row's long-tailed workload, if any. Stopped after
    --timeout seconds, or at the call's deadline (--budget): a call that a time limit would kill would leave no
    report."""
    from aligner_ext.distributed import free_port

    peaks = out / f"{name}.peaks"
    shutil.rmtree(peaks, ignore_errors=True)
    peaks.mkdir(parents=True)
    torchrun = (["-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--master_port={free_port()}"]
                if processes > 1 else [])  # one process is a world of one without torchrun, as `aligner-ext train` runs
    command = [sys.executable, *torchrun, str(HERE / "multi_gpu_rank.py"), *overrides]
    pythonpath = os.pathsep.join(filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MULTI_GPU_PEAKS=str(peaks), PYTHONPATH=pythonpath, PYTHONFAULTHANDLER="1",
               MULTI_GPU_LONG_TAIL=long_tail,
               **({} if os.environ.get("OMP_NUM_THREADS") else {"OMP_NUM_THREADS": "1"}))
    print(f"== {name}: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    timeout = max(0.0, min(args.timeout, args.deadline - started))
    with open(out / f"{name}.log", "w") as log:
        launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True)
        try:
            code = launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # torchrun passes SIGTERM on to its workers; SIGKILL what is left
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            code = f"ran past {timeout:.0f} s"
    print(f"   exit {code} after {time.perf_counter() - started:.0f} s: {out / name}.log", flush=True)
    ranks = {path.stem.removeprefix("rank"): json.loads(path.read_text()) for path in sorted(peaks.glob("rank*.json"))}
    return code, (out / f"{name}.log").read_text(errors="replace"), dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))


def failure_line(log: str, code: int | str) -> str:
    """What a failed run failed with, in one line: the library's own line, else the first exception raised (a
    rank that failed first is the cause; the others' collectives fail after it)."""
    for pattern in (USER_ERROR, RAISED):
        found = pattern.findall(log)
        if found:
            return f"exit {code}: {found[0].strip()}"
    return f"exit {code}: no error line in the log"


def median_range(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def summarise(run_dir: Path, log: str, row: Row, model: dict, preset: Preset, matmul_rate: float,
              saved: bool = True) -> dict:
    """The run's figures (module docstring) over its steps after the first; `saved`: whether its final
    checkpoint was written (a run cut short may not have written it)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("step", 0) > 1 and "timing/step_s" in r]
    step_s = [r["timing/step_s"] for r in timed]
    # the prompts' measured length (the tokenizer's count), the workload's where a run did not log it
    prompts = [r.get("prompt/length_mean", preset.prompt_length) for r in timed]
    mfu = []
    for r, prompt in zip(timed, prompts):
        sequences, response = int(r["batch/num_samples"]), r["response/length_mean"]
        flops = train_flops(model, [prompt + response] * sequences, [response] * sequences)
        mfu.append(flops / r["timing/train_s"] / (matmul_rate * row.layout.processes))
    gaps = [r["rollout/logprob_diff_mean"] for r in timed if "rollout/logprob_diff_mean" in r]
    saves = save_summary(run_dir, log, row.save_every, row.steps)
    final = run_dir / "checkpoints" / f"step_{row.steps}"
    return {"step_s": median_range(step_s), "steps_s": saves["step_s"],
            "prompt_tokens": statistics.median(prompts),
            "steps_phases_s": [{"generation": r.get("timing/rollout_s"), "train": r.get("timing/train_s")}
                               for r in records if "timing/step_s" in r],  # what made a step slow, step by step
            "samples_per_s": statistics.median(r["batch/num_samples"] / r["timing/step_s"] for r in timed),
            # on a long tail steps differ by their long prompts: the rate over the run, and the responses' length
            "samples_per_s_over_run": sum(r["batch/num_samples"] for r in timed) / sum(step_s),
            "response_length_mean": statistics.fmean(r["response/length_mean"] for r in timed),
            "generation_s": statistics.median(r["timing/rollout_s"] for r in timed),
            "train_s": statistics.median(r["timing/train_s"] for r in timed),
            "train_mfu": statistics.median(mfu),
            "logprob_gap": statistics.median(gaps) if gaps else None,
            "checkpoint": {"bytes": sum(p.stat().st_size for p in final.rglob("*") if p.is_file()) if saved else None,
                           "optimizer": row.save, "write_s": saves["final_save_s"],
                           "stall_per_save_s": saves["stall_per_save_s"],
                           "mean_stall_per_save_s": saves["mean_stall_per_save_s"]}}


def run_row(row: Row, preset: Preset, model: dict, workspace: Path, out: Path, args, matmul_rate: float) -> dict:
    """The row's main run, its variants and its resume (module docstring)."""
    result = {"layout": row.layout.describe(), "dp": row.layout.dp, "shape": row.shape,
              "batch": f"{row.prompts} x {row.n}, P {preset.prompt_length} + R {preset.response_length}"
                       + (f" (long-tailed by {row.long_tail[:-1]}: {LONG_SHARE:.0%} R, the others R / {LONG_FACTOR})"
                          if row.long_tail else "")}
    run_dir = workspace / "runs" / row.name
    shutil.rmtree(workspace / "runs", ignore_errors=True)  # an earlier call's, cut short
    code, log, result["peak_gib"] = launch(row.name, row.layout.processes,
                                           settings(row, row.layout, preset, workspace, row.name, row.steps),
                                           out, args, row.long_tail)
    history = run_dir / "metrics.jsonl"
    if code != 0:
        records = [json.loads(line) for line in history.read_text().splitlines()] if history.exists() else []
        done = sum("timing/step_s" in r for r in records)  # trained steps (step 0 may hold an evaluation alone)
        if not (isinstance(code, str) and done >= 2):  # a failure, or a time limit before a step could be timed
            return {**result, "failed": failure_line(log, code)}
        # a time limit stopped a run that trained: its steps are measured all the same (at 8B the final save alone
        # can outlast a call), the variants and the resume are not run
        written = (run_dir / "checkpoints" / f"step_{row.steps}" / "manifest.json").exists()
        result["failed"] = (f"cut short: {code} (--timeout or --budget), after {done} of {row.steps} steps; "
                            f"the final checkpoint {'written' if written else 'not written'}")
        return {**result, **summarise(run_dir, log, row, model, preset, matmul_rate, written)}
    if not history.exists():  # exit 0 without a step logged
        return {**result, "failed": failure_line(log, code)}
    result.update(summarise(run_dir, log, row, model, preset, matmul_rate))
    if result["prompt_tokens"] != preset.prompt_length:  # the model saw other prompts than the workload's
        result["failed"] = (f"its prompts were {result['prompt_tokens']:.0f} tokens, not the workload's "
                            f"{preset.prompt_length}: the tokenizer did not encode the rows as they were written")
    if row.variants:
        result["variants"] = {}
    for variant in row.variants:
        name = f"{row.name}-{variant}"
        weights_only = {"trainer.save_optimizer": "false", "trainer.save_every": 0}  # the main run measures saves
        overrides = settings(row, row.layout, preset, workspace, name, row.variant_steps, variant, weights_only)
        code, log, peaks = launch(name, row.layout.processes, overrides, out, args, row.long_tail)
        history = workspace / "runs" / name / "metrics.jsonl"
        steps = [json.loads(line) for line in history.read_text().splitlines()] if history.exists() else []
        result["variants"][variant] = {"steps": len(steps), "step_s": [r["timing/step_s"] for r in steps],
                                       "peak_gib": peaks, **({"failed": failure_line(log, code)} if code else {})}
    if row.resume:
        result["resume"] = resume(row, preset, workspace, out, args)
    return result


def resume(row: Row, preset: Preset, workspace: Path, out: Path, args) -> dict:
    """The row's final checkpoint resumed at `row.resume` for one more step, whose checkpoint holds the weights
    alone (the optimizer's state is loaded all the same): the disk holds one full checkpoint, not two."""
    name = f"{row.name}-resumed"
    overrides = settings(row, row.resume, preset, workspace, row.name, row.steps + 1,
                         extra={"trainer.resume": "true", "trainer.save_optimizer": "false"})
    code, log, peaks = launch(name, row.resume.processes, overrides, out, args, row.long_tail)
    result = {"layout": row.resume.describe(), "peak_gib": peaks}
    if code != 0:
        return {**result, "failed": failure_line(log, code)}
    resumed = RESUMED.findall(log)
    records = [json.loads(line) for line in (workspace / "runs" / row.name / "metrics.jsonl").read_text().splitlines()]
    after = [r["timing/step_s"] for r in records if r.get("step") == row.steps + 1]
    return {**result, "resumed_from_step": int(resumed[0]) if resumed else None, "step_s": after[0] if after else None}


def render(report: dict) -> str:
    hardware = report["hardware"]
    lines = [f"# The multi-GPU table ({report['date']}, {hardware['device_name']}, {report['capacity']} "
             f"{'GPUs' if hardware['device'] == 'cuda' else 'processes'}; matrix rate {hardware['matmul']} "
             f"{hardware['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s per device)", "", f"`{report['command']}`", "",
             "| row | shape, layout | batch | step s, median [range] | samples/s (x 1 GPU) | generation s | train s | "
             "train MFU | peak GiB per rank | checkpoint | resumed | failed or skipped |", "| --- " * 12 + "|"]
    rows = report["rows"]
    for name, r in rows.items():
        head = f"| {name} | {r.get('shape', '')}, {r.get('layout', '')} | {r.get('batch', '')} |"
        if "step_s" not in r:  # failed (its ranks' peaks say whether memory ran out) or skipped
            lines.append(head + " |" * 5 + f" {peaks(r.get('peak_gib', {}))} | | | {r.get('failed') or r.get('skipped')} |")
            continue
        singles = [s for s in rows.values() if s.get("shape") == r["shape"] and s.get("layout", "").startswith("1 GPU")
                   and "samples_per_s" in s]  # the same batch's first, else the shape's: a rate compares across batches
        single = next((s for s in singles if s.get("batch") == r["batch"]), singles[0] if singles else None)
        ratio = f" ({r['samples_per_s'] / single['samples_per_s']:.2f}x)" if single and single is not r else ""
        save = r["checkpoint"]
        stall = (f"; stall per background save {save['mean_stall_per_save_s']:.1f} s"
                 if save["mean_stall_per_save_s"] is not None else "")
        checkpoint = ("not written" if save["bytes"] is None else
                      f"{save['bytes'] / 1e9:.1f} GB{' with optimizer' if save['optimizer'] else ''}, written in "
                      f"{save['write_s'] or 0:.1f} s{stall}")
        back = r.get("resume")
        resumed = "" if not back else (f"{back['layout']}: failed" if "failed" in back else
                                       f"{back['layout']}: from step {back['resumed_from_step']}, a step of "
                                       f"{back['step_s']:.2f} s, peak {peaks(back['peak_gib'])}")
        failures = [r["failed"]] if "failed" in r else []  # a run cut short by a time limit
        failures += [f"resume: {back['failed']}"] if back and "failed" in back else []
        failures += [f"{v}: {s['failed']}" for v, s in r.get("variants", {}).items() if "failed" in s]
        lines.append(head + f" {r['step_s'][0]:.2f} [{r['step_s'][1]:.2f}, {r['step_s'][2]:.2f}] | "
                     f"{r['samples_per_s']:.1f}{ratio} | {r['generation_s']:.2f} | {r['train_s']:.2f} | "
                     f"{100 * r['train_mfu']:.1f}% | {peaks(r['peak_gib'])} | {checkpoint} | {resumed} | "
                     f"{'; '.join(failures)} |")
    timed = [(name, r) for name, r in rows.items() if r.get("steps_phases_s")]
    if timed:
        lines += ["", "Every step, seconds: the step (generation + train), the first compiling:", ""]
        lines += [f"- {name}: " + ", ".join(f"{step:.2f} ({phases['generation'] or 0:.2f} + {phases['train'] or 0:.2f})"
                                            for step, phases in zip(r["steps_s"], r["steps_phases_s"]))
                  for name, r in timed]
    gaps = [(name, r["logprob_gap"]) for name, r in rows.items() if r.get("logprob_gap") is not None]
    if gaps:
        lines += ["", "The engine's log-probs against the trainer's (`rollout/logprob_diff_mean`, the median over "
                  "the steps after the first):", ""]
        lines += [f"- {name}: {gap:.5f}" for name, gap in gaps]
    variants = [(name, v, s) for name, r in rows.items() for v, s in r.get("variants", {}).items()]
    if variants:
        lines += ["", "Variants at the row's layout (steps run, each step's seconds):", ""]
        lines += [f"- {name} +variant={v}: {s['steps']} steps, "
                  + (", ".join(f"{t:.2f}" for t in s["step_s"]) or "-") + (f"; {s['failed']}" if "failed" in s else "")
                  for name, v, s in variants]
    return "\n".join(lines)


def peaks(ranks: dict) -> str:
    """Every rank's peak: reserved on a GPU (what the device had to give), resident memory on the CPU."""
    return ", ".join(f"{rank}: {p.get('reserved', p.get('resident')):.1f}" for rank, p in ranks.items()) or "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="table-2gpu", help="comma-separated rows or presets of multi_gpu_rows.py")
    parser.add_argument("--processes", type=int, default=2, help="on the CPU: processes a row may use (gloo)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--budget", type=float, default=7200, help="seconds for the call: no row starts with less "
                        f"than {ROW_LEAST_S} s of them left, no run goes on past them (where a lent machine's command "
                        "has a time limit, less than it)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.deadline = time.perf_counter() + args.budget
    try:
        rows = named_rows(args.rows)
    except ValueError as err:
        parser.error(str(err))  # one line, exit 2
    import torch
    from grpo_step import measure_hardware

    device = "cuda" if torch.cuda.is_available() else "cpu"
    capacity = torch.cuda.device_count() if device == "cuda" else args.processes
    hardware = {"device": device, **(measure_hardware(device) if device == "cuda" else
                                     measure_hardware(device, matmul_size=256, copy_elements=2**16))}
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "hardware": hardware, "capacity": capacity,
              "command": "multi-gpu " + " ".join(sys.argv[1:] if argv is None else argv), "rows": {}}
    prepared = {}
    for index, row in enumerate(rows):
        unit = "GPUs" if device == "cuda" else "processes (--processes)"
        if row.processes > capacity:
            report["rows"][row.name] = {"layout": row.layout.describe(), "shape": row.shape,
                                        "skipped": f"skipped: needs {row.processes} {unit}, this machine has {capacity}"}
        elif args.deadline - time.perf_counter() < ROW_LEAST_S:
            report["rows"][row.name] = {"layout": row.layout.describe(), "shape": row.shape,
                                        "skipped": f"not started: less than {ROW_LEAST_S} s of the call's --budget of "
                                                   f"{args.budget:.0f} s was left"}
        else:
            if row.shape not in prepared:  # distinct prompts for every step of the shape's longest run
                needed = max(r.prompts * (r.steps + r.variant_steps + 1) for r in rows if r.shape == row.shape)
                prepared[row.shape] = prepare(row.shape, needed, args.out / "work", device)
            preset, model = prepared[row.shape]
            workspace = args.out / "work" / row.shape
            report["rows"][row.name] = run_row(row, preset, model, workspace, args.out, args,
                                               hardware["matmul_flops_per_s"])
            shutil.rmtree(workspace / "runs", ignore_errors=True)  # the row's checkpoints, failed or not
            if all(later.shape != row.shape for later in rows[index + 1:]):
                shutil.rmtree(args.out / "work" / row.shape, ignore_errors=True)
        write_json(args.out / "multi_gpu.json", report)
        (args.out / "multi_gpu.md").write_text(render(report) + "\n")
    print(render(report))
    failed = [name for name, row in report["rows"].items() if "failed" in row]
    if failed:  # the table is written all the same; a skipped row is no failure
        print(f"rows that failed: {', '.join(failed)} (the table's last column says why)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
