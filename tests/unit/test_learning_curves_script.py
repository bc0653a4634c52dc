"""scripts/learning_curves.py's parts that decide what docs/learning.md says: the final means and
their spread over seeds, the verdict against the baseline, the comparisons counted as finished, and
the lock that keeps two invocations from training one run (which would mix two runs' files)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("learning_curves", ROOT / "scripts" / "learning_curves.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def test_finals_are_the_last_values_mean_and_sample_std(script):
    runs = [{"val/accuracy": [(0, 0.3), (10, 0.5)]}, {"val/accuracy": [(0, 0.3), (10, 0.7)]},
            {"val/accuracy": [(0, 0.3), (10, 0.6)]}]
    mean, std = script.finals(runs, "val/accuracy")
    assert mean == pytest.approx(0.6)
    assert std == pytest.approx(0.1)  # sqrt(((-0.1)^2 + 0.1^2 + 0) / 2)
    assert math.isnan(script.finals([{}], "val/accuracy")[0])


def test_the_verdict_compares_the_difference_with_the_larger_spread(script):
    assert script.against_baseline(0.62, 0.01, 0.60, 0.03) == "+0.020 (within the seeds' spread)"
    assert script.against_baseline(0.55, 0.01, 0.60, 0.03) == "-0.050 (beyond the seeds' spread)"


def test_a_comparison_counts_as_finished_when_every_run_of_it_has_finished(script, tmp_path):
    comparison = next(c for c in script.COMPARISONS if c.title == "arithmetic_lora")
    for method in comparison.methods:
        for seed in (0, 1):
            directory = script.run_dir(tmp_path, comparison.task, method, seed)
            directory.mkdir(parents=True)
            (directory / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/accuracy": 0.25}) + "\n")
            if (method.name, seed) != ("LoRA r32", 1):
                (directory / "summary.json").write_text("{}")
    assert "arithmetic_lora" not in script.finished_comparisons(tmp_path, [0, 1])
    (script.run_dir(tmp_path, "arithmetic", comparison.methods[-1], 1) / "summary.json").write_text("{}")
    finished = script.finished_comparisons(tmp_path, [0, 1])["arithmetic_lora"]
    assert finished["LoRA r8"] == [{"val/accuracy": [(0, 0.25)]}] * 2


def test_a_run_another_invocation_trains_is_refused_not_trained_twice(script, tmp_path):
    method = script.GRPO
    directory = script.run_dir(tmp_path, "arithmetic", method, 0)
    directory.parent.mkdir(parents=True)
    (directory.parent / "seed0.training").touch()
    with pytest.raises(RuntimeError, match="being trained by another invocation"):
        script.train(tmp_path, "arithmetic", method, 0, quick=True)
    assert not directory.exists()


def test_diagnostics_are_run_means_averaged_over_seeds_and_dashes_where_absent(script):
    comparison = script.Comparison("arithmetic", (script.Method("GRPO", ()), script.Method("DAPO", ())),
                                   diagnostics=("dynamic_sampling/num_gen_batches",))
    curves = {"GRPO": [{}, {}],
              "DAPO": [{"dynamic_sampling/num_gen_batches": [(1, 1.0), (2, 3.0)]},  # run mean 2
                       {"dynamic_sampling/num_gen_batches": [(1, 1.0), (2, 1.0), (3, 1.0)]}]}  # run mean 1
    rows = script.diagnostics_table(comparison, curves)
    assert rows[2:] == ["| GRPO | - |", "| DAPO | 1.500 |"]
