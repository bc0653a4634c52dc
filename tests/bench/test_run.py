"""The benchmark entry point (scripts/bench/run.py) and what its subcommands share (common.py): slow
steps flagged with their events, the opening table of docs/benchmarks.md made from result.json files,
the GPU carry's check against the machine's package list, and a CPU run of the subcommands that have
no test file of their own (the log-prob head, generation, serving, the first step)."""

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "scripts"))

import run  # noqa: E402
from common import StepEvents, slow_steps, steps_line  # noqa: E402
from prepare_gpu_carry import missing, pure, setup_requirements  # noqa: E402


def test_steps_above_1_3x_the_median_are_flagged_with_their_events():
    records = [{"step_s": seconds, "events": {}} for seconds in (1.0, 1.1, 0.9, 1.0)]
    records.append({"step_s": 3.7, "events": {"compiled_graphs": 2, "compile_s": 1.7, "gc_collections": 0}})
    assert slow_steps([record["step_s"] for record in records]) == [4]
    assert slow_steps([1.0, 5.0]) == []  # two steps have no median to speak of
    line = steps_line("ours", records)
    assert line.startswith("ours: 1.00 1.10 0.90 1.00 3.70*;")
    assert "step 4 (3.70 s > 1.3 x median): {'compiled_graphs': 2, 'compile_s': 1.7}" in line


def test_step_events_count_a_full_collection():
    events = StepEvents(cuda=False)
    gc.collect()
    taken = events.take()
    assert taken["gc_collections"] == 1 and taken["gc_s"] >= 0
    assert events.take()["gc_collections"] == 0  # counted once


def test_the_opening_table_has_date_machine_commit_and_command_on_every_row(tmp_path, monkeypatch):
    env = {"date": "2026-11-25 16:38 UTC", "machine": "x86_64, 16 cores", "gpu": "NVIDIA H100 80GB HBM3",
           "commit": "abc1234", "command": "python scripts/bench/run.py families --families llama3,olmo2"}
    family = {"auto_engine": "rollout", "params": 1.2e9, "decode_tokens_per_s": 3e4, "step_s": 1.0, "hf_train_mfu": 0.5,
              "peak_gib": {"generation": 10.0, "train": 18.0}, "megatron_peak_gib": 33.0,
              "grpo_steps": [{"step_s": 1.0}] * 3, "megatron_calls": [{"train_s": 0.5}] * 6}
    report = {"families": {"llama3": {**family, "decode_bound_share": 0.5, "megatron_train_mfu": 0.4},
                           "olmo2": {**family, "decode_bound_share": 0.45, "megatron_train_mfu": 0.44}}}
    (tmp_path / "families.json").write_text(json.dumps({"subcommand": "families", "env": env, "report": report}))
    monkeypatch.setattr(run, "RESULTS", tmp_path)
    rows = run.table().splitlines()
    assert rows[0] == "| measurement | result | date | machine | commit | command |"
    assert len(rows) == 4
    olmo2 = rows[3]
    assert "of the bound 50.0% (1.00x" not in rows[2]  # Llama is the reference
    assert "of the bound 45.0% (0.90x Llama's)" in olmo2 and "Megatron MFU 44.0% (1.10x Llama's)" in olmo2
    assert "HF MFU 50.0% (1.00x Llama's)" in olmo2 and "(1.20B), 3 steps, 6 Megatron train calls" in olmo2
    assert "| 2026-11-25 16:38 UTC | NVIDIA H100 80GB HBM3 | abc1234 | `python scripts/bench/run.py families" in olmo2
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n{run.TABLE_START}\nold\n{run.TABLE_END}\nrest\n")
    run.write_table(doc)
    assert doc.read_text() == f"# Title\n{run.TABLE_START}\n{run.table()}\n{run.TABLE_END}\nrest\n"


def test_the_gpu_carry_takes_only_what_the_machine_lacks():
    names = {requirement.name for requirement in setup_requirements(["bench"])}
    assert {"torch", "hydra-core", "trl"} <= names and "megatron-core" not in names
    installed = {"torch": "2.11.0", "fsspec": "2026.7.0"}
    assert not missing(Requirement("torch>=2.6"), installed)
    assert missing(Requirement("fsspec<=2025.9.0"), installed)  # there, at a version the requirement excludes
    assert missing(Requirement("trl==1.16.0"), installed)
    assert pure(Path("multiprocess-0.70.19-py312-none-any.whl"))
    assert not pure(Path("jiter-0.19.0-cp312-cp312-manylinux2014_x86_64.whl"))


def run_subcommand(tmp_path: Path, *argv: str) -> dict:
    subprocess.run([sys.executable, str(BENCH / "run.py"), *argv, "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["subcommand"] == argv[0] and result["env"]["command"].startswith(f"python scripts/bench/run.py {argv[0]}")
    return result["report"]


@pytest.mark.slow
def test_the_logprob_head_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "logprob-head", "--tiny")
    assert len(report["heads"]) == 4
    for head in report["heads"]:  # float32 against float64: rounding only
        assert head["logprob_err_max"] < 1e-4 and head["grad_weight_rel_err"] < 1e-4


@pytest.mark.slow
def test_generation_alone_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "rollout", "--preset", "tiny", "--engines", "eager", "--repeats", "1",
                            "--no-checks")
    assert set(report["engines"]) == {"eager"} and report["failures"] == {}
    assert report["engines"]["eager"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_serving_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "serving", "--preset", "tiny", "--repeats", "1")
    assert set(report["weight_push"]) == {"disk", "distributed"} and report["server_weights_equal_after_push"]


@pytest.mark.slow
def test_the_first_step_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "first-step", "--preset", "tiny", "--systems", "ours")
    assert report["failures"] == {}, report["failures"]  # the worker's exit and log, if it failed
    ours = report["systems"]["ours"]
    assert ours["first_step_s"] > 0 and len(ours["steps"]) == 1
    assert (tmp_path / "ours.first_step_profile.txt").exists()


@pytest.mark.slow
def test_the_lora_step_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "lora", "--tiny", "--warmup", "0", "--steps", "1")
    assert report["lora"]["rank"] > 0 and "ours" in report["systems"]
    assert report["systems"]["ours"]["step_s"][0] > 0
    assert report["logprob_check"]["ours"]["relative_l2"] < 1e-5  # B starts at 0: the base model's log-probs


@pytest.mark.slow
def test_the_moe_step_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "moe", "--tiny", "--warmup", "0", "--steps", "1", "--micro-batch", "2",
                            "--set", "policy.kernels=none")
    assert report["preset"]["micro_batch"] == 2 and report["preset"]["name"].endswith("_micro_batch_2")
    assert "policy.kernels=none" in report["systems"]["ours"]["settings"]["overrides"]
    model = report["hardware"]["model"]
    assert report["workload"] == "moe" and "lora" not in report and model["experts"] == 8 and model["top_k"] == 2
    # the body counts a token's 2 experts of 3 * 64 * 32 weights each and the 8 x 64 router, beside attention
    attention = 64 * (4 * 16 + 2 * 2 * 16) + 4 * 16 * 64
    assert model["body_matmul_params"] == 2 * (attention + 2 * 3 * 64 * 32 + 8 * 64)
    assert report["systems"]["ours"]["step_s"][0] > 0 and report["logprob_check"]["ours"]["relative_l2"] < 1e-5


def test_one_moe_layer_per_experts_implementation_on_the_cpu(tmp_path):
    report = run_subcommand(tmp_path, "moe-experts", "--device", "cpu", "--tokens", "40", "--hidden", "32",
                            "--intermediate", "16", "--experts", "8", "--top-k", "2", "--steps", "1", "--warmup", "0")
    runs = report["runs"]["40"]
    assert {"transformers", "ours", "grouped_products_only"} <= runs.keys()
    for name in ("transformers", "ours"):  # float32 on the CPU: transformers' eager experts to rounding
        errors = runs[name]["relative_errors"]
        assert set(errors) == {"output", "grad_input", "grad_gate.weight", "grad_experts.gate_up_proj",
                               "grad_experts.down_proj"} and max(errors.values()) < 1e-5
    rows = run.headline({"subcommand": "moe-experts", "report": report})
    assert len(rows) == len(runs) and rows[0][0].startswith("MoE layer forward + backward, ")


def test_the_families_table_takes_each_family_from_the_latest_file_by_its_number(tmp_path, monkeypatch):
    """File 10 was measured after file 9 (a sort by name would put it first and keep file 9's figures)."""
    env = {"date": "2026-11-26 01:00 UTC", "machine": "x86_64", "gpu": "NVIDIA H200", "commit": "abc1234",
           "command": "python scripts/bench/run.py families"}

    def write(name: str, olmo_mfu: float) -> None:
        family = {"auto_engine": "rollout", "params": 1.2e9, "decode_tokens_per_s": 3e4, "step_s": 1.0,
                  "decode_bound_share": 0.5, "megatron_train_mfu": 0.4, "peak_gib": {"train": 18.0},
                  "megatron_peak_gib": 33.0}
        report = {"families": {"llama3": {**family, "hf_train_mfu": 0.6}, "olmo2": {**family, "hf_train_mfu": olmo_mfu}}}
        (tmp_path / name).write_text(json.dumps({"subcommand": "families", "env": env, "report": report}))

    write("9_families_before.json", 0.3)
    write("10_families_after.json", 0.6)
    monkeypatch.setattr(run, "RESULTS", tmp_path)
    olmo2 = next(line for line in run.families_table().splitlines() if line.startswith("| olmo2 "))
    assert "| 60.0% (1.00x) |" in olmo2 and "10_families_after.json" in olmo2 and "9_families" not in olmo2


@pytest.mark.parametrize("module_name", sorted({module for module, _, _ in run.SUBCOMMANDS.values()}))
def test_every_subcommands_help_prints(module_name, capsys):
    """argparse formats help strings with %: a bare one (a percentage in an f-string) breaks --help."""
    import importlib

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module_name).main(["--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
