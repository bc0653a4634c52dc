"""The stall a checkpoint costs training (`run.py save-stall`): `aligner-ext train` at a preset's shape on the
GRPO benchmark's workspace (random weights, prompts of the preset's length, responses of its full length),
saving every --save-every steps, run twice: `trainer.async_save=false` (the loop writes the checkpoint) and
`true` (the loop returns once the files are in host memory; a writer finishes them while the next steps train).

Per run the report gives the step times (metrics.jsonl's timing/step_s), the seconds the loop waited for each
save (the checkpointer's "the loop waited" line) and the stall per periodic save: what the loop waited plus how
much longer the step after it took than the median step (a background writer shares the host and the disk).
The final save is always in the foreground (the run ends after it) and is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ROOT, slow_steps  # noqa: E402
from grpo_step_lib import PRESETS, write_json, write_workspace  # noqa: E402
from grpo_step_ours import overrides  # noqa: E402

WAITED = re.compile(r"checkpoint step_(\d+): the loop waited ([\d.]+) s")
BACKENDS = {"hf": [], "megatron": ["policy.backend=megatron", "policy.micro_batch_tokens=8192"]}


def settings(preset, workspace: Path, backend: str, steps: int, save_every: int, background: bool) -> list[str]:
    """The GRPO benchmark's overrides for our rollout engine, as a training run that saves."""
    name = f"{backend}_async_save_{str(background).lower()}"
    mine = {"trainer.run_name": name, "trainer.total_steps": steps, "trainer.save_every": save_every,
            "trainer.async_save": str(background).lower(), "trainer.keep_last": 1, "trainer.export_hf": "false"}
    theirs = [o for o in overrides(preset, workspace, "none", 1e-6, "rollout") if o.split("=", 1)[0] not in mine]
    return theirs + BACKENDS[backend] + [f"{key}={value}" for key, value in mine.items()]


def run(command: list[str], log: Path, timeout: float) -> tuple[int | str, str]:
    """Exit status (or why none) and output of one training run (its reward function is this folder's)."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as handle:
        try:
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    print(f"   exit {code} after {time.perf_counter() - started:.0f} s: {log}", flush=True)
    return code, log.read_text(errors="replace")


def summarise(run_dir: Path, log: str, save_every: int, steps: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["timing/step_s"] for r in records if "timing/step_s" in r}
    waited = {int(step): float(seconds) for step, seconds in WAITED.findall(log)}
    median = statistics.median(step_s[s] for s in step_s if s > 1)  # the first step compiles
    periodic = [s for s in waited if s < steps]
    stall = {s: waited[s] + max(0.0, step_s.get(s + 1, median) - median) for s in periodic}
    return {"step_s": [step_s[s] for s in sorted(step_s)], "median_step_s": median, "waited_s": waited,
            "stall_per_save_s": stall,
            "mean_stall_per_save_s": statistics.mean(stall.values()) if stall else None,
            "final_save_s": waited.get(steps), "slow_steps": slow_steps([step_s[s] for s in sorted(step_s)]),
            "save_every": save_every}


def render(report: dict) -> str:
    lines = [f"# The stall of a checkpoint: {report['preset']}, backend {report['backend']}, "
             f"a save every {report['save_every']} of {report['steps']} steps", "",
             "| trainer.async_save | median step | loop waited per periodic save | stall per periodic save "
             "| final save (foreground) | step times |", "| --- | --- | --- | --- | --- | --- |"]
    for mode, s in report["runs"].items():
        if "failed" in s:
            lines.append(f"| {mode} | failed: {s['failed']} | | | | |")
            continue
        periodic = [f"{v:.2f}" for k, v in sorted(s["waited_s"].items()) if k < report["steps"]]
        lines.append(f"| {mode} | {s['median_step_s']:.2f} s | {', '.join(periodic)} s | "
                     f"{s['mean_stall_per_save_s']:.2f} s | {s['final_save_s'] or 0:.1f} s | "
                     f"{', '.join(f'{t:.2f}' for t in s['step_s'])} |")
    runs = report["runs"]
    if all("mean_stall_per_save_s" in runs.get(m, {}) for m in ("false", "true")) and runs["false"]["mean_stall_per_save_s"]:
        lines += ["", f"Background saves stall a save {runs['true']['mean_stall_per_save_s'] / runs['false']['mean_stall_per_save_s']:.3f}x "
                      "as long as foreground ones."]
    lines += ["", f"`python scripts/bench/run.py {report['command']}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="megatron")
    parser.add_argument("--steps", type=int, default=7, help="training steps per run")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    workspace = args.out / "work"
    write_workspace(preset, preset.prompts * (args.steps + 1), workspace)
    report = {"preset": preset.name, "backend": args.backend, "steps": args.steps, "save_every": args.save_every,
              "command": " ".join(["save-stall", *(sys.argv[1:] if argv is None else argv)]), "runs": {}}
    for background in (False, True):
        mode = str(background).lower()
        command = [sys.executable, "-m", "aligner_ext", "train",
                   *settings(preset, workspace, args.backend, args.steps, args.save_every, background)]
        print(f"== trainer.async_save={mode}: {' '.join(command)}", flush=True)
        code, log = run(command, args.out / f"async_save_{mode}.log", args.timeout)
        run_dir = workspace / "runs" / f"{args.backend}_async_save_{mode}"
        if code != 0 or not (run_dir / "metrics.jsonl").exists():
            report["runs"][mode] = {"failed": f"exit {code}, see async_save_{mode}.log"}
        else:
            report["runs"][mode] = summarise(run_dir, log, args.save_every, args.steps)
        write_json(args.out / "save_stall.json", report)
        (args.out / "save_stall.md").write_text(render(report) + "\n")
    print(render(report))
    if any("failed" in s for s in report["runs"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
