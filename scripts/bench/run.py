"""Every benchmark behind a decision of docs/benchmarks.md, one entry point:

    python scripts/bench/run.py SUBCOMMAND [options]       # options: python scripts/bench/run.py SUBCOMMAND --help
    python scripts/bench/run.py table                      # docs/benchmarks.md's opening table from docs/bench_results/

Subcommands (SUBCOMMANDS below): the GRPO step against TRL's GRPOTrainer, the first step on empty
compile caches, the rollout engine alone, the Megatron backend's training step per family, every
family's table (engine, decode, MFU, GRPO step, memory), sliding windows that bite, the log-prob
head, serving, the GRPO step with LoRA, the GRPO step on multi-turn agent episodes, the stall of a checkpoint, the multi-GPU table. Each writes its report (markdown and JSON) under --out (default bench_out/<subcommand>)
and result.json there: the report with the date, machine, GPU, commit and command it was measured
with. Every step's time is in the report, a step above 1.3x the median of its series starred with
what happened in it (compilations, garbage collections, the allocator, new Triton kernels:
common.StepEvents). `--prev COMMIT_OR_TREE` (grpo, megatron) runs an earlier commit's library in the
same call; profiles: `grpo --torch-profile train,generation`, `megatron --profile`, `rollout --profile`.
On a GPU machine: scripts/bench/gpu.sh SUBCOMMAND [options] (docs/benchmarks.md, "Reproducing").
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ROOT, environment  # noqa: E402

RESULTS = ROOT / "docs" / "bench_results"  # the result.json files the opening table is made from
TABLE_START, TABLE_END = "<!-- run.py table: start -->", "<!-- run.py table: end -->"
FAMILIES_START, FAMILIES_END = "<!-- run.py families: start -->", "<!-- run.py families: end -->"
TARGET = 0.85  # every family within 15% of Llama's share of the decode bound and MFU, measured in the same call

# subcommand: (module, the report its main writes under --out, what it measures)
SUBCOMMANDS = {
    "grpo": ("grpo_step", "grpo_step.json", "the whole GRPO step, ours against TRL's GRPOTrainer, against its floor; "
             "--asynchronous K: ours generating ahead against synchronous, --disaggregated K: the same with "
             "generation on a second GPU's server, --long-tail: long-tailed lengths"),
    "first-step": ("grpo_step", "grpo_step.json", "the first GRPO step on empty torch.compile / Triton caches"),
    "rollout": ("rollout_engine", "rollout_engine.json", "generation alone: the rollout engine's settings and the HF engine"),
    "megatron": ("megatron_families", "megatron_families.json", "the Megatron backend's train call per family, profiled"),
    "families": ("families", "families.json", "every family at ~1B: engine, decode, MFU on both backends, step, memory"),
    "sliding-window": ("sliding_window", "sliding_window.json", "windows that bite: agreement with transformers, speed"),
    "logprob-head": ("logprob_head", "logprob_head.json", "the fused log-prob head against the chunked one"),
    "serving": ("serving", "serving.json", "generation through `aligner-ext serve`, and weight pushes"),
    "lora": ("shape_step", "shape_step.json", "the GRPO step with LoRA at the Llama-3.1-8B shape, ours against TRL"),
    "moe": ("shape_step", "shape_step.json", "the GRPO step of a mixture of experts scaled to one GPU, ours against TRL"),
    "moe-experts": ("moe_experts", "moe_experts.json", "one MoE layer's forward and backward per experts implementation"),
    "agents": ("agent_step", "agent_step.json", "the GRPO step on agent episodes with a 50 ms tool: ours, turn by turn, TRL"),
    "save-stall": ("save_stall", "save_stall.json", "the stall a checkpoint costs training, foreground and background saves"),
    "multi-gpu": ("multi_gpu", "multi_gpu.json", "the multi-GPU table: `aligner-ext train` per layout under torchrun, "
                  "--rows table-2gpu or table-4gpu"),
}


def run(subcommand: str, argv: list[str]) -> int:
    """The subcommand's main on `argv` (with --out defaulted), then result.json beside its report."""
    module_name, report_name, _ = SUBCOMMANDS[subcommand]
    if "--out" not in argv:
        argv = [*argv, "--out", str(ROOT / "bench_out" / subcommand)]
    out = Path(argv[argv.index("--out") + 1]).resolve()
    if subcommand == "first-step":  # empty compile caches, for this run and its workers
        caches = Path(tempfile.mkdtemp(prefix="bench_caches_"))
        os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
        argv = ["--variants", "", "--warmup", "1", "--steps", "1", "--profile-first-step", *argv]
    env = environment([subcommand, *argv])
    if module_name == "shape_step":  # one script, a workload per subcommand
        argv = ["--workload", subcommand, *argv]
    report = out / report_name
    report.unlink(missing_ok=True)  # an earlier run's report is not this run's result
    code = 0
    try:
        importlib.import_module(module_name).main(argv)
    except SystemExit as stop:  # a failed check still leaves its report
        code = stop.code if isinstance(stop.code, int) else 1
    if report.exists():
        result = {"subcommand": subcommand, "env": env, "report": json.loads(report.read_text())}
        (out / "result.json").write_text(json.dumps(result, indent=2))
        print(f"\n{out / 'result.json'}: {env['date']}, {env['gpu'] or env['machine']}, {env['commit']}")
    return code


def headline(result: dict) -> list[tuple[str, str]]:
    """(measurement, result) rows of one result.json for the opening table."""
    report = result["report"]
    if result["subcommand"] in ("grpo", "first-step", "lora", "moe"):
        preset = report["preset"]
        tail = report.get("long_tail")
        shape = (f"{preset['name']}: {preset['prompts']} x {preset['n']} sequences, P {preset['prompt_length']} + "
                 f"R {preset['response_length']}"
                 + (f", long-tailed ({tail['share']:.0%} {'of the prompts ' if tail.get('by_prompt') else ''}R, "
                    f"the others R / {tail['factor']})" if tail else ""))
        rows = []
        for name, s in report["systems"].items():
            name += "".join(f" ({setting})" for setting in s.get("settings", {}).get("overrides", ())
                            if setting.startswith("rollout.carry_over"))
            slow = sum(1 for step in s["steps"] if step["step_s"] > 1.3 * s["step_s"][0])
            overlap = s.get("overlap", {})
            if overlap.get("asynchronous"):
                synchronous = report["systems"].get(overlap["synchronous"], {}).get("overlap")
                ratio = f" ({overlap['samples_per_s'] / synchronous['samples_per_s']:.2f}x synchronous)" if synchronous else ""
                stale = overlap["staleness"]
                rows.append((f"GRPO step generated ahead, {name}, {shape}",
                             f"{overlap['samples_per_s']:.1f} samples/s{ratio}; step {s['step_s'][0]:.2f} s "
                             f"[{s['step_s'][1]:.2f}, {s['step_s'][2]:.2f}] over {len(s['steps'])} steps; generation "
                             f"{overlap['generation_s']:.2f} s, train {overlap['train_s']:.2f} s, trainer wait "
                             f"{overlap['trainer_wait_s']:.2f} s, generator idle {overlap['generator_idle_s']:.2f} s; "
                             f"staleness mean {stale['mean']:.2f}, max {stale['max']:.0f}"))
                continue
            rows.append((f"GRPO step, {name}, {shape}",
                         f"{s['step_s'][0]:.2f} s [{s['step_s'][1]:.2f}, {s['step_s'][2]:.2f}] over {len(s['steps'])} "
                         f"steps ({slow} above 1.3x the median); generation {s['phases_s']['generation']:.2f} s "
                         f"({100 * s['decode_bound_share']:.0f}% of the decode bound), train {s['phases_s']['train']:.2f} s "
                         f"({100 * s['train_mfu']:.0f}% MFU); {s['step_over_floor']:.1f}x the floor; first step "
                         f"{s['first_step_s']:.1f} s"))
        return rows
    if result["subcommand"] == "families":
        rows, llama = [], report["families"].get("llama3", {})

        def share(s: dict, key: str, label: str) -> str:
            ratio = f" ({s[key] / llama[key]:.2f}x Llama's)" if s is not llama and key in llama else ""
            return f"{label} {100 * s[key]:.1f}%{ratio}"

        for name, s in report["families"].items():
            if "failed" in s:
                rows.append((f"{name} at ~1B", s["failed"]))
                continue
            parts = [f"engine {s['auto_engine']}"]
            if "decode_bound_share" in s:
                parts += [f"decode {s['decode_tokens_per_s']:,.0f} tokens/s, " + share(s, "decode_bound_share", "of the bound"),
                          share(s, "hf_train_mfu", "HF MFU"), f"step {s['step_s']:.2f} s",
                          f"peak {s['peak_gib']['train']:.1f} GiB (HF)"]
            else:
                parts.append(f"GRPO step not run: {s['grpo_error']}")
            if "megatron_train_mfu" in s:
                parts += [share(s, "megatron_train_mfu", "Megatron MFU"), f"peak {s['megatron_peak_gib']:.1f} GiB (Megatron)"]
            else:
                parts.append(f"Megatron train call not run: {s['megatron_error'] or 'the call ran out of time'}")
            steps = f"{len(s.get('grpo_steps', []))} steps, {len(s.get('megatron_calls', []))} Megatron train calls"
            rows.append((f"{name} at ~1B ({s['params'] / 1e9:.2f}B), {steps}", "; ".join(parts)))
        return rows
    if result["subcommand"] == "megatron":
        rows, llama = [], report["families"].get("llama3", {})
        depth = own_depth(report)
        size = f"{depth} layers of the ~1B shape" if depth else "~1B"
        for name, s in report["families"].items():
            if "train_s" in s:
                ratio = f" ({s['train_mfu'] / llama['train_mfu']:.2f}x Llama's)" if s is not llama and llama else ""
                rows.append((f"{name} at {size}, Megatron train call, TP=1 ({len(s['calls'])} calls)",
                             f"{s['train_s'][0]:.3f} s [{s['train_s'][1]:.3f}, {s['train_s'][2]:.3f}], MFU "
                             f"{100 * s['train_mfu']:.1f}%{ratio}; peak {s['peak_gib']:.1f} GiB"))
        return rows
    if result["subcommand"] == "agents":
        preset = report["preset"]
        shape = (f"{preset['name']}: {preset['prompts']} x {preset['n']} episodes of {preset['min_turns']}-"
                 f"{preset['max_turns']} turns of {preset['turn_tokens']} tokens, 50 ms tool")
        ours = report["systems"].get("ours")
        return [(f"GRPO step on agent episodes, {name}, {shape}",
                 f"{s['step_s'][0]:.2f} s [{s['step_s'][1]:.2f}, {s['step_s'][2]:.2f}]"
                 + (f" ({s['step_s'][0] / ours['step_s'][0]:.2f}x ours)" if ours and s is not ours else "")
                 + f"; generation {s['phases_s']['generation']:.2f} s (engine {s['engine_s']:.2f} s); prefilled "
                 f"{s['prefill']['later_prefilled_per_turn']:.1f} tokens per later turn for "
                 f"{s['prefill']['later_new_per_turn']:.1f} new")
                for name, s in report["systems"].items()]
    if result["subcommand"] == "moe-experts":
        shape = report["shape"]
        return [(f"MoE layer forward + backward, {name}, {tokens} tokens (hidden {shape['hidden']}, {shape['experts']} "
                 f"experts of {shape['intermediate']}, top-{shape['top_k']})",
                 f"{run['ms']:.2f} ms, MFU {100 * run['mfu']:.1f}%, peak {run['peak_mib']:.0f} MiB")
                for tokens, runs in report["runs"].items() for name, run in runs.items()]
    return []


def result_files() -> list[Path]:
    """docs/bench_results/*.json in the order they were measured: by their leading number (10 after 9;
    a name without one first), then by name."""
    def order(path: Path) -> tuple[int, str]:
        number = path.name.split("_", 1)[0]
        return int(number) if number.isdigit() else 0, path.name

    return sorted(RESULTS.glob("*.json"), key=order)


def table() -> str:
    """The opening table: a row per measurement of every result.json in docs/bench_results/."""
    lines = ["| measurement | result | date | machine | commit | command |", "| --- " * 6 + "|"]
    for path in result_files():
        result = json.loads(path.read_text())
        env = result["env"]
        machine = env["gpu"] or env["machine"]
        for what, value in headline(result):
            command = re.sub(r" --out \S+", "", env["command"])  # where the files went: not part of the measurement
            lines.append(f"| {what} | {value} | {env['date']} | {machine} | {env['commit']} | "
                         f"`{command}` ([{path.name}](bench_results/{path.name})) |")
    return "\n".join(lines)


def own_depth(report: dict) -> str | None:
    """The layers a `megatron` report's families were cut to (`--layers`), None at their ~1B depth."""
    depth = re.search(r"--layers (\d+)", report.get("command", ""))
    return depth.group(1) if depth else None


def families_table() -> str:
    """Each family's latest measurement at ~1B in docs/bench_results/ (a later file replaces an earlier
    one), every rate also as a multiple of Llama's from the same call; under TARGET in bold."""
    latest: dict[str, dict] = {}
    for path in result_files():
        result = json.loads(path.read_text())
        if result["subcommand"] not in ("families", "megatron") or own_depth(result["report"]):
            continue  # a depth of its own (a mixture of experts cut to fit one GPU) is not the ~1B shape
        rows = result["report"]["families"]
        llama = rows.get("llama3", {})
        for name, s in rows.items():
            entry = latest.setdefault(name, {})
            if "decode_bound_share" in s:
                entry.update(grpo=(s, llama), grpo_file=path.name)
            mfu = s.get("megatron_train_mfu") or s.get("train_mfu")
            if mfu:
                entry.update(megatron=(mfu, llama.get("megatron_train_mfu") or llama.get("train_mfu"),
                                       s.get("megatron_peak_gib") or s.get("peak_gib")), megatron_file=path.name)

    def rate(value: float, reference: float | None) -> str:
        ratio = value / reference if reference else 1.0
        text = f"{ratio:.2f}x"
        return f"{100 * value:.1f}% ({'**' + text + '**' if ratio < TARGET else text})"

    lines = ["| family | params | engine (auto) | decode tokens/s | share of the decode bound (x Llama's) | "
             "Megatron train MFU (x Llama's) | HF train MFU (x Llama's) | GRPO step s | peak GiB: HF train / "
             "Megatron train | measured in |", "| --- " * 10 + "|"]
    for name, entry in latest.items():
        (s, llama), (mfu, llama_mfu, peak) = entry["grpo"], entry["megatron"]
        files = sorted({entry["grpo_file"], entry["megatron_file"]})
        lines.append(f"| {name} | {s['params'] / 1e9:.2f}B | {s['auto_engine']} | {s['decode_tokens_per_s']:,.0f} | "
                     f"{rate(s['decode_bound_share'], llama['decode_bound_share'])} | {rate(mfu, llama_mfu)} | "
                     f"{rate(s['hf_train_mfu'], llama['hf_train_mfu'])} | {s['step_s']:.2f} | "
                     f"{s['peak_gib']['train']:.1f} / {peak:.1f} | "
                     + ", ".join(f"[{name}](bench_results/{name})" for name in files) + " |")
    return "\n".join(lines)


def write_table(doc: Path = ROOT / "docs" / "benchmarks.md") -> None:
    """Replace what stands between each pair of markers of `doc` with `table()` and `families_table()`."""
    text = doc.read_text()
    for (start_marker, end_marker), render in (((TABLE_START, TABLE_END), table),
                                               ((FAMILIES_START, FAMILIES_END), families_table)):
        if start_marker in text:
            start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
            text = text[:start] + "\n" + render() + "\n" + text[end:]
    doc.write_text(text)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*SUBCOMMANDS, "table"):
        print(__doc__ + "\n" + "\n".join(f"  {name:15} {what}" for name, (_, _, what) in SUBCOMMANDS.items()))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "table":
        write_table()
        return 0
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
