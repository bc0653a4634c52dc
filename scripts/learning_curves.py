"""docs/learning.md: whether each variant, estimator and loss does on the built-in tasks what its paper
claims, from runs of `aligner-ext demo` (3 seeds each, on 2 CPU cores), with curves as plots.

Each comparison trains a method and its plain-GRPO baseline on the same task from the same warmed
model, differing only in the method's switches and in trainer.seed (which sets the sampling). The
runs are kept in --runs-dir and reused: a finished run (its summary.json) is not run again, so an
interrupted call picks up where it stopped.

    python scripts/learning_curves.py                     # every comparison, 3 seeds: about 2 h on 2 cores
    python scripts/learning_curves.py --only arithmetic   # one task's comparisons
    python scripts/learning_curves.py --quick             # 2 steps, 1 seed, small sets: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "learning.md"
FIGURES = ROOT / "docs" / "learning"
EVAL_EVERY = 10  # held-out evaluations every this many steps: the curves' resolution


@dataclass(frozen=True)
class Method:
    """One line of a comparison: a name and the overrides of `aligner-ext demo` that make it."""

    name: str
    overrides: tuple[str, ...]
    claim: str = ""  # what its paper says it does better than GRPO, as the table states it


@dataclass(frozen=True)
class Comparison:
    """Methods trained on one task; the first is the baseline the others are compared with."""

    task: str
    methods: tuple[Method, ...]
    metrics: tuple[str, ...] = ("val/accuracy",)  # held-out metrics in the table, the first one plotted


GRPO = Method("GRPO", ())
COMPARISONS = (  # the two-method comparisons first: they finish sooner
    Comparison("mtpo_qa", (
        Method("GRPO", ("+variant=mtpo", "mtpo.rewards.calibration_weight=0")),
        Method("MTPO", ("+variant=mtpo",), "lower calibration error at equal accuracy"),
    ), metrics=("val/accuracy", "val/brier", "val/ece")),
    Comparison("rubric_qa", (
        Method("GRPO", ("+variant=graded_prompt", "algorithm.experience_maker=group_sampling",
                        "graded_prompt.enabled=false")),
        Method("graded prompt", ("+variant=graded_prompt",), "higher rubric score"),
    ), metrics=("val/reward_mean", "val/accuracy")),
    Comparison("arithmetic", (
        GRPO,
        Method("DAPO", ("+variant=dapo",), "reaches GRPO's accuracy in fewer optimizer steps"),
        Method("RLOO", ("algorithm.adv_estimator=rloo",), "an unbiased leave-one-out baseline"),
        Method("REINFORCE++", ("algorithm.adv_estimator=reinforce_plus_plus",), "batch-normalised, no group baseline"),
        Method("REINFORCE++-baseline", ("algorithm.adv_estimator=reinforce_plus_plus_baseline",),
               "group baseline, then batch normalisation"),
        Method("GSPO", ("algorithm.loss=gspo", "loss.agg_mode=seq-mean-token-mean"), "sequence-level ratio: steadier"),
        Method("CISPO", ("algorithm.loss=cispo",), "keeps the gradient of clipped tokens"),
        Method("CPO", ("+variant=cpo",), "gold-solution hints sharpen the advantage per token"),
    )),
)
QUICK = ("trainer.total_steps=2", "trainer.eval.every=1", "model.warmup.steps=2", "data.builtin_val_size=8",
         "data.builtin_train_size=64", "data.train_batch_size=4")


def run_dir(runs: Path, task: str, method: Method, seed: int) -> Path:
    return runs / task / method.name.replace(" ", "_").replace("+", "p") / f"seed{seed}"


def train(runs: Path, task: str, method: Method, seed: int, quick: bool) -> Path:
    """Run one method at one seed (unless it finished before); its run directory."""
    directory = run_dir(runs, task, method, seed)
    if (directory / "summary.json").is_file():
        return directory
    command = [sys.executable, "-m", "aligner_ext", "demo", *method.overrides, f"trainer.seed={seed}",
               f"trainer.output_dir={directory.parent}", f"trainer.run_name={directory.name}",
               f"trainer.eval.every={EVAL_EVERY}", "trainer.cpu_threads=1", "trainer.progress_bar=false",
               *(QUICK if quick else ())]
    started = time.time()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.log", "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{task} / {method.name} / seed {seed} failed (exit {result.returncode}): "
                           f"{directory.parent / (directory.name + '.log')}")
    print(f"{task:>10} {method.name:>22} seed {seed}: {time.time() - started:5.0f} s", flush=True)
    return directory


def held_out(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every held-out metric of a run, as (step, value) points."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith("val/") and isinstance(value, (int, float)):
                curves.setdefault(key, []).append((record["step"], float(value)))
    return curves


def mean_curve(runs: list[dict], metric: str) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over seeds at the steps every seed evaluated."""
    by_step = [dict(run.get(metric, [])) for run in runs]
    steps = sorted(set.intersection(*(set(points) for points in by_step))) if by_step else []
    out = []
    for step in steps:
        values = [points[step] for points in by_step]
        out.append((step, sum(values) / len(values), min(values), max(values)))
    return out


def first_step_reaching(curve, target: float) -> int | None:
    return next((step for step, mean, _, _ in curve if mean >= target), None)


def summarize(comparison: Comparison, curves: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: each method's final metrics (mean ± std over seeds) and its steps to GRPO's final accuracy."""
    baseline = comparison.methods[0].name
    headline = comparison.metrics[0]
    base_curve = mean_curve(curves[baseline], headline)
    target = base_curve[-1][1] if base_curve else math.nan
    rows = []
    for method in comparison.methods:
        cells = []
        for metric in comparison.metrics:
            finals = [run[metric][-1][1] for run in curves[method.name] if run.get(metric)]
            mean = sum(finals) / len(finals) if finals else math.nan
            std = math.sqrt(sum((x - mean) ** 2 for x in finals) / (len(finals) - 1)) if len(finals) > 1 else 0.0
            start = curves[method.name][0].get(metric, [(0, math.nan)])[0][1]
            cells.append(f"{start:.3f} → {mean:.3f} ± {std:.3f}")
        reached = first_step_reaching(mean_curve(curves[method.name], headline), target)
        rows.append(f"| {method.name} | {' | '.join(cells)} | {reached if reached is not None else 'not reached'} "
                    f"| {method.claim or 'baseline'} |")
    return rows


def plot(comparison: Comparison, curves: dict[str, list[dict]], path: Path) -> None:
    """The headline metric per step: each method's mean over seeds, its min-max band shaded."""
    from matplotlib.figure import Figure

    metrics = comparison.metrics
    figure = Figure(figsize=(5.2 * len(metrics), 4.0), layout="constrained")
    figure.suptitle(f"{comparison.task}: held-out metrics per step (mean over seeds, band: min-max)")
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    for axis, metric in zip(axes, metrics):
        for index, method in enumerate(comparison.methods):
            curve = mean_curve(curves[method.name], metric)
            if not curve:
                continue
            steps, means, lows, highs = zip(*curve)
            axis.plot(steps, means, label=method.name, color=f"C{index}", marker="o", markersize=3)
            axis.fill_between(steps, lows, highs, color=f"C{index}", alpha=0.15)
        axis.set_xlabel("step")
        axis.set_ylabel(metric.removeprefix("val/"))
        axis.set_title(metric)
        axis.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)))
    figure.savefig(path, dpi=110)


def render(results: dict[str, dict[str, list[dict]]], seeds: list[int], steps: int, command: str) -> str:
    lines = ["# What the variants, estimators and losses do on the built-in tasks", "",
             f"Regenerated by `{command}` on the 2-core CPU development machine ({time.strftime('%Y-%m-%d')}):",
             f"`aligner-ext demo` runs of {steps} steps from the same warmed model per task, seeds "
             f"{', '.join(map(str, seeds))} (trainer.seed sets the sampling), held-out evaluation every {EVAL_EVERY} steps.",
             "Each cell: the held-out value before RL → after it (mean ± standard deviation over seeds). The steps",
             "column: the first evaluation at which the method's mean reaches the baseline's final value.", ""]
    for comparison in COMPARISONS:
        if comparison.task not in results:
            names = ", ".join(method.name for method in comparison.methods)
            lines += [f"## {comparison.task}", "", f"Not run yet ({names}): `python scripts/learning_curves.py --only "
                      f"{comparison.task}` adds it.", ""]
            continue
        curves = results[comparison.task]
        lines += [f"## {comparison.task}", "", f"![{comparison.task}](learning/{comparison.task}.png)", "",
                  f"| method | {' | '.join(comparison.metrics)} | steps to GRPO's final {comparison.metrics[0]} | "
                  "the paper's claim |",
                  "| --- | " + "--- | " * len(comparison.metrics) + "--- | --- |",
                  *summarize(comparison, curves), ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "learning", help="kept runs (reused)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", help="tasks to run (default: all)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once, one compute thread each")
    parser.add_argument("--quick", action="store_true", help="2 steps, small sets: checks the script end to end")
    parser.add_argument("--doc", type=Path, default=DOC, help="where the page goes (figures beside it in learning/)")
    args = parser.parse_args()
    comparisons = [c for c in COMPARISONS if not args.only or c.task in args.only]
    jobs = [(c.task, m, s) for c in comparisons for m in c.methods for s in args.seeds]
    with ThreadPoolExecutor(args.parallel) as pool:
        directories = list(pool.map(lambda job: train(args.runs_dir, *job, args.quick), jobs))
    results: dict[str, dict[str, list[dict]]] = {}
    for (task, method, _), directory in zip(jobs, directories):
        results.setdefault(task, {}).setdefault(method.name, []).append(held_out(directory))
    figures = args.doc.parent / "learning"
    figures.mkdir(parents=True, exist_ok=True)
    for comparison in comparisons:
        plot(comparison, results[comparison.task], figures / f"{comparison.task}.png")
    command = " ".join(["python scripts/learning_curves.py", *(["--quick"] if args.quick else []),
                        *(["--only", *args.only] if args.only else [])])
    steps = json.loads((directories[0] / "summary.json").read_text())["steps"]
    args.doc.write_text(render(results, args.seeds, steps, command))
    print(f"wrote {args.doc} and {len(comparisons)} figures in {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
