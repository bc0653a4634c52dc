"""The GRPO step on multi-turn agent episodes with a 50 ms tool: ours on the rollout engine's turn
sessions, against the same engine turn by turn without overlap and TRL's GRPOTrainer with its tool loop.

    python scripts/bench/run.py agents --preset qwen1_5b --budget 540     # one GPU
    python scripts/bench/run.py agents --preset tiny                      # the 2-core CPU

The workload (agent_step_lib.py), the same for every system: G prompts x n episodes per step, each
of 3 to 5 model turns (fixed per row and copy from a seed), every turn exactly `turn_tokens` tokens
(EOS ignored), every turn but the last answered by the tool `lookup`, which replies after 50 ms with
the same 16 words (random weights never write a real call, so the environment ignores the text; TRL's
parsed turns get the call added, agent_step_trl.py). Qwen2.5's chat template with the tool's schema,
random weights at the preset's shape (bf16 on a GPU), the same learning rate, KL off, one update a step.

One call writes the workspace, then runs each system of --systems in its own process, one after
another (`--warmup` steps, then `--steps` measured):
  ours               the agent-episodes maker's GRPO step (algorithm.experience_maker=agent_episodes)
                     on the rollout engine's turn sessions (scripts/bench/agent_step_ours.py)
  ours_turn_by_turn  the same loop and engine without overlap: every running episode's turn t in one
                     `generate` call, then all the tools, then turn t + 1 (the engine's prefix cache
                     kept between its calls)
  trl_fast, trl_cb   TRL's GRPOTrainer with `tools=[lookup]`: its tool loop on transformers' `generate`
                     (bf16, no gradient checkpointing) or continuous batching (scripts/bench/agent_step_trl.py:
                     no vLLM needed; turn-synchronous, the tools of a turn run one episode after another)
then writes `agent_step.md` and `agent_step.json` under --out (after every worker, so a call's time
limit loses no finished result).

Before / after in one call: with `--prev COMMIT` (or a folder holding its tree), a system written
`prev:ours` or `prev:ours_turn_by_turn` runs this harness's worker with that tree's library, and the
report adds the ratios of each system to its `prev:` counterpart. `--profile` runs one more step of
this tree's `ours` with its episodes under cProfile (ours.profile.txt: the episode loop's and the
engine's host time), `--torch-profile generation` one more under torch.profiler (the device's busy
time against the wall time).

Per system, medians over the measured steps: the step; generation, the episodes' wall time (every turn
and tool call); engine, the host time in the engine's calls (each waits for the device work it
reads), so generation - engine is the time the episodes spent outside the engine (on the tools, and
for TRL its parsing); the other phases; turns and sampled tokens per step (equal work: the same for
every system); tokens prefilled per turn against the turn's new tokens, those whose K/V the episode
has not computed: the prompt for a first turn (our engine prefills a group's shared prompt once),
after that the last sampled token (never fed back), the template's boundary and the tool's reply.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from agent_step_lib import PRESETS, TOOL_LATENCY_S, write_workspace  # noqa: E402
from common import prev_tree, steps_line  # noqa: E402
import grpo_step  # noqa: E402
from grpo_step import PHASES, median_range, run_worker  # noqa: E402

SYSTEMS = {"ours": ("agent_step_ours.py", ["--mode", "sessions"]),
           "ours_turn_by_turn": ("agent_step_ours.py", ["--mode", "turn_by_turn"]),
           "trl_fast": ("agent_step_trl.py", ["--mode", "fast"]), "trl_cb": ("agent_step_trl.py", ["--mode", "cb"])}
COUNTS = ("episodes", "turns", "sampled_tokens", "first_turn_new", "first_turn_prefilled", "later_turns", "later_new",
          "later_prefilled", "prefilled", "reused", "recomputed", "evictions", "decode_steps")
PREV_PREFIX = "prev:"  # a system run with the library of --prev (module docstring)


def summarise(result: dict) -> dict:
    """Medians of the measured steps' times; the token counts summed over them, per turn or per episode."""
    measured = result["steps"][result["warmup_steps"]:]
    total = {key: sum(step.get(key) or 0 for step in measured) for key in COUNTS}
    phases = {phase: statistics.median(step["phases_s"].get(phase, 0.0) for step in measured) for phase in PHASES}
    engine_s = statistics.median(step["engine_s"] for step in measured)
    later = max(total["later_turns"], 1)
    first = result["steps"][0]
    return {
        "step_s": median_range([step["step_s"] for step in measured]), "phases_s": phases, "engine_s": engine_s,
        "engine_ms_per_decode_step": 1000 * sum(step["engine_s"] for step in measured) / total["decode_steps"]
        if total["decode_steps"] else None,
        "outside_engine_s": phases["generation"] - engine_s,
        "peak_gib": {phase: max(step["peak_gib"].get(phase, 0.0) for step in measured) for phase in PHASES},
        "turns_per_step": [step["turns"] for step in measured],
        "sampled_tokens_per_step": [step["sampled_tokens"] for step in measured],
        "prefill": {
            "later_prefilled_per_turn": total["later_prefilled"] / later, "later_new_per_turn": total["later_new"] / later,
            "first_turn_prefilled_per_episode": total["first_turn_prefilled"] / max(total["episodes"], 1),
            "first_turn_new_per_episode": total["first_turn_new"] / max(total["episodes"], 1),
            "reused_per_turn": total["reused"] / max(total["turns"], 1), "recomputed": total["recomputed"],
            "evictions": total["evictions"], "totals": total,
            "history_rewrites": sum(step.get("history_rewrites", 0) for step in measured),
        },
        "startup_s": result["startup_s"], "first_step_s": first["step_s"], "first_step_done_at_s": first["ended_at_s"],
        "settings": result["settings"],
        "steps": [{"step_s": step["step_s"], "phases_s": step["phases_s"], "engine_s": step["engine_s"],
                   "events": step.get("events", {})} for step in measured],
    }


def render(report: dict) -> str:
    preset, lengths = report["preset"], report["lengths"]
    systems = report["systems"]
    ours = systems.get("ours")
    lines = [
        f"GRPO step on agent episodes, preset `{preset['name']}` ({report['date']}, {lengths['params'] / 1e6:,.0f}M "
        f"parameters): {preset['prompts']} prompts x n={preset['n']} episodes of {preset['min_turns']}-"
        f"{preset['max_turns']} turns of {preset['turn_tokens']} tokens, a {1000 * TOOL_LATENCY_S:.0f} ms tool "
        f"after every turn but the last (its reply {lengths['reply_tokens']} tokens with the template's), prompts "
        f"{lengths['prompt_tokens']} tokens.",
        "",
        "| system | step s, median [min, max] | x ours | generation s | engine s | outside the engine s | train s "
        "| log-probs s | other s | turns / step | sampled tokens / step | prefilled / new tokens per later turn "
        "| prefilled / new per first turn | reused per turn | peak GiB gen / train | first step s (done at) |",
        "| --- " * 16 + "|",
    ]
    for name, s in systems.items():
        p, fill = s["phases_s"], s["prefill"]
        ratio = f"{s['step_s'][0] / ours['step_s'][0]:.2f}x" if ours else "-"
        lines.append(
            f"| {name} | {s['step_s'][0]:.2f} [{s['step_s'][1]:.2f}, {s['step_s'][2]:.2f}] | {ratio} "
            f"| {p['generation']:.2f} | {s['engine_s']:.2f} | {s['outside_engine_s']:.2f} | {p['train']:.2f} "
            f"| {p['logprobs']:.2f} | {p['other'] + p['rewards'] + p['weight_sync']:.2f} "
            f"| {'/'.join(map(str, s['turns_per_step']))} | {'/'.join(map(str, s['sampled_tokens_per_step']))} "
            f"| {fill['later_prefilled_per_turn']:.1f} / {fill['later_new_per_turn']:.1f} "
            f"| {fill['first_turn_prefilled_per_episode']:.1f} / {fill['first_turn_new_per_episode']:.1f} "
            f"| {fill['reused_per_turn']:.1f} | {s['peak_gib']['generation']:.1f} / {s['peak_gib']['train']:.1f} "
            f"| {s['first_step_s']:.1f} ({s['first_step_done_at_s']:.1f}) |")
    lines += ["", "Recomputed tokens, evictions and history rewrites (new training rows) over the measured steps: "
              + "; ".join(f"{name} {s['prefill']['recomputed']}, {s['prefill']['evictions']}, "
                          f"{s['prefill']['history_rewrites']}" for name, s in systems.items()) + ".",
              "", "Every measured step, seconds (* above 1.3x the median, with what happened in it):", ""]
    lines += [f"- {steps_line(name, s['steps'])}" for name, s in systems.items()]
    per_step = [f"{name} {s['engine_ms_per_decode_step']:.2f}" for name, s in systems.items()
                if s.get("engine_ms_per_decode_step")]
    if per_step:
        lines += ["", "Engine host time per decode step of a turn session, ms: " + "; ".join(per_step) + "."]
    lines += after_before(systems)
    for name, error in report["failures"].items():
        lines.append(f"\n{name} did not finish: {error}")
    return "\n".join(lines)


def after_before(systems: dict) -> list[str]:
    """This tree over --prev's, per system run from both (medians; below 1 is faster)."""
    pairs = [(name, systems[PREV_PREFIX + name]) for name in systems if PREV_PREFIX + name in systems]
    if not pairs:
        return []
    lines = ["", "After / before (this tree over `--prev`'s, medians; below 1 is faster):", "",
             "| system | step | generation | engine | train |", "| --- | --- | --- | --- | --- |"]
    for name, prev in pairs:
        now = systems[name]
        lines.append(f"| {name} | {now['step_s'][0] / prev['step_s'][0]:.3f} "
                     f"| {now['phases_s']['generation'] / prev['phases_s']['generation']:.3f} "
                     f"| {now['engine_s'] / prev['engine_s']:.3f} | {now['phases_s']['train'] / prev['phases_s']['train']:.3f} |")
    return lines


def write_report(report: dict, out: Path, started: float) -> str:
    return grpo_step.write_report(report, out, started, "agent_step", render)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--systems", default="ours,ours_turn_by_turn,trl_fast",
                        help="comma-separated, from " + ", ".join(SYSTEMS))
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per system")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per worker process")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds for the whole call: a worker gets at most what is left")
    parser.add_argument("--out", type=Path, default=None, help="default: bench_out/agent_step_<preset>")
    parser.add_argument("--prev", type=prev_tree, default=None,
                        help="an earlier commit or its tree: systems written prev:NAME run with its library")
    parser.add_argument("--profile", action="store_true", help="one more step of ours under cProfile")
    parser.add_argument("--torch-profile", default="", help="phases of one more step of ours under torch.profiler")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted({system.removeprefix(PREV_PREFIX) for system in systems} - set(SYSTEMS))
    if unknown:
        sys.exit(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    preset = PRESETS[args.preset]
    out = (args.out or ROOT / "bench_out" / f"agent_step_{args.preset}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    lengths = write_workspace(preset, args.warmup + args.steps, out / "work")
    print(f"== workspace: {time.perf_counter() - started:.0f} s, {lengths}", flush=True)
    report = {"preset": preset.__dict__, "lengths": lengths, "systems": {}, "failures": {},
              "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv[1:] if argv is None else argv)}
    common = ["--workspace", str(out / "work"), "--warmup", str(args.warmup), "--steps", str(args.steps),
              "--lr", str(args.lr)]
    if any(system.startswith(PREV_PREFIX) for system in systems) and args.prev is None:
        sys.exit("--systems: name the earlier tree of the prev: systems with --prev")
    for system in systems:
        base = system.removeprefix(PREV_PREFIX)
        script, extra = SYSTEMS[base]
        extra = [*extra, "--system", system] if script == "agent_step_ours.py" else extra
        if system == "ours":
            extra += ["--profile"] if args.profile else []
            extra += ["--torch-profile", args.torch_profile] if args.torch_profile else []
        stem = system.replace(":", "_")  # file names without the colon
        left = min(args.timeout, args.budget - (time.perf_counter() - started) - 15)
        result, why = run_worker(stem, [sys.executable, str(HERE / script), *common, *extra,
                                        "--out", str(out / f"{stem}.json")], out, left,
                                 args.prev if base != system else ROOT)
        if result is not None and len(result["steps"]) <= result["warmup_steps"]:
            result, why = None, f"{why or 'stopped'}: no measured step finished"
        if result is None:
            report["failures"][system] = why
        else:
            report["systems"][system] = summarise(result)
        write_report(report, out, started)
    print(write_report(report, out, started))


if __name__ == "__main__":
    main()
