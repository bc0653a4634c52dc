"""The GRPO-step benchmark (`run.py grpo`, scripts/bench/grpo_step.py): its bounds, its phase accounting,
and a small run of our side on the CPU (TRL is not installed in CI; the side by side is in
docs/benchmarks.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from grpo_step import floors, ratio_lines  # noqa: E402
from grpo_step_lib import PRESETS, PhaseClock, Preset, prompt_ids, write_workspace  # noqa: E402


def test_floors_by_hand():
    # 2 prompts x n=2 (B = 4), P = 3, R = 2; float32 words (CPU): 4 bytes
    preset = Preset("t", "char", 8, 2, 2, 1, 16, 0, prompts=2, n=2, prompt_length=3, response_length=2,
                    micro_batch=4, device="cpu", variant_steps=1)
    model = {"layers": 2, "hidden": 8, "body_matmul_params": 1000, "head_params": 200, "kv_values_per_token": 10}
    hardware = {"model": model, "copy_bytes_per_s": 1e4, "matmul_flops_per_s": 1e6}
    floor = floors(preset, hardware)
    # decoding step t reads the weights (1200 x 4 bytes) and 4 sequences x (3 + t) tokens x 40 bytes
    step1 = 4800 + 4 * 4 * 40
    step2 = 4800 + 4 * 5 * 40
    assert floor["decode_bound_s"] == pytest.approx((step1 + step2) / 1e4)
    # per sequence: 6 x 1000 x 5 + 6 x 200 x 2 + 12 x 2 x 8 x 25 = 30000 + 2400 + 4800
    assert floor["train_flops"] == 4 * 37200
    prefill = 2 * (2 * 1000 * 3 + 4 * 2 * 8 * 9)  # the 2 distinct prompts only
    assert floor["prefill_floor_s"] == pytest.approx(prefill / 1e6)
    expected = floor["decode_bound_s"] + prefill / 1e6 + 4 * 37200 * (1 + 1 / 3) / 1e6
    assert floor["step_floor_s"] == pytest.approx(expected)


def test_ratios_after_over_before_per_phase():
    phases = {"generation": 2.0, "logprobs": 0.0, "train": 1.0, "weight_sync": 0.1, "rewards": 0.01, "other": 0.2}
    before = {"step_s": [4.0, 4.0, 4.0], "phases_s": phases, "peak_gib": {"train": 10.0}}
    after = {"step_s": [3.0, 3.0, 3.0], "phases_s": {**phases, "generation": 1.0}, "peak_gib": {"train": 12.0}}
    lines = ratio_lines({"prev:ours": before, "ours": after, "other": after})
    # one row, for the system run from both trees; "-" where the phase took no time
    assert lines[-1] == "| ours | 0.750 | 0.500 | - | 1.000 | 1.000 | 1.000 | 1.000 | 1.200 |"
    assert sum(line.startswith(("| ours", "| other")) for line in lines) == 1


def test_varying_prompt_widths_change_every_step_and_the_probe_keeps_p_tokens(tmp_path):
    """--vary-prompt-widths: each step's 4 rows (the tiny preset) hold one prompt of the step's width,
    a width in [P / 2, P] other than the step before's, and shorter ones; the probe's prompts have P."""
    import torch
    from transformers import AutoTokenizer

    preset = PRESETS["tiny"]
    write_workspace(preset, 5 * preset.prompts, tmp_path, vary_widths=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    lengths = [len(prompt_ids(tokenizer, row["prompt"][0]["content"])) for row in rows]
    steps = [lengths[start : start + preset.prompts] for start in range(0, len(lengths), preset.prompts)]
    widths = [max(step) for step in steps]
    assert all(step[0] == width for step, width in zip(steps, widths))
    assert all(preset.prompt_length // 2 <= width <= preset.prompt_length for width in widths)
    assert all(before != after for before, after in zip(widths, widths[1:]))
    assert any(length < width for step, width in zip(steps, widths) for length in step)
    assert torch.load(tmp_path / "probe.pt")["prompt_ids"].shape == (4, preset.prompt_length)


class ScriptedClock(PhaseClock):
    """A phase clock reading scripted times instead of the wall clock."""

    def __init__(self, times):
        self.times = iter(times)
        super().__init__("cpu")

    def _now(self):
        return next(self.times)


def test_phase_clock_charges_each_interval_to_the_innermost_phase():
    clock = ScriptedClock([0.0, 1.0, 3.0, 6.0, 10.0, 15.0])
    clock.push("generation")  # at 1: [0, 1] was outside any phase
    clock.push("rewards")  # at 3: [1, 3] generation
    clock.pop()  # at 6: [3, 6] rewards
    clock.pop()  # at 10: [6, 10] generation again
    record = clock.take_step()  # at 15: [10, 15] outside
    assert record["phases_s"] == {"other": 1.0 + 5.0, "generation": 2.0 + 4.0, "rewards": 3.0}
    assert record["step_s"] == 15.0


@pytest.mark.slow
def test_our_side_on_the_cpu(tmp_path):
    preset = PRESETS["tiny"]
    command = [sys.executable, str(BENCH / "run.py"), "grpo", "--preset", "tiny", "--systems", "prev:ours,ours",
               "--variants", "mtpo", "--steps", "1", "--variant-steps", "1", "--profile-first-step", "--torch-profile", "train",
               "--prev", str(BENCH.parents[1]), "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    result = json.loads((tmp_path / "result.json").read_text())
    assert {"date", "machine", "commit", "command"} <= set(result["env"]) and result["subcommand"] == "grpo"
    report = result["report"]
    assert report["failures"] == {}
    # the before / after plumbing (this tree on both sides here): both measured, a ratio per phase,
    # and this tree's side profiled one more step
    assert set(report["systems"]) == {"prev:ours", "ours"}
    assert "| ours | " in (tmp_path / "grpo_step.md").read_text().split("After / before")[1]
    assert (tmp_path / "ours.torch_profile.txt").read_text().startswith("train (call 0")
    assert not (tmp_path / "prev_ours.torch_profile.txt").exists()
    ours = report["systems"]["ours"]
    # every response ran to R tokens (EOS ignored) and the trainer saw P + R per sequence
    assert ours["response_lengths"] == [preset.response_length, preset.response_length]
    assert ours["tokens_per_sequence"] == [preset.prompt_length + preset.response_length] * 2
    assert ours["generated_tokens"] == preset.prompts * preset.n * preset.response_length
    # float32 on the CPU: our log-probs are the float64 reference's up to rounding
    assert report["logprob_check"]["ours"]["relative_l2"] < 1e-5
    # the phases of every step add up to it, and every step says what happened in it
    for step in json.loads((tmp_path / "ours.json").read_text())["steps"]:
        assert sum(step["phases_s"].values()) == pytest.approx(step["step_s"])
        assert "gc_collections" in step["events"]
    assert "Every measured step" in (tmp_path / "grpo_step.md").read_text()
    # MTPO: G = 2 answers of R tokens per prompt, then n = 8 confidences of R / 2
    mtpo = report["variants"]["mtpo"]
    assert mtpo["generated_tokens"] == preset.prompts * (2 * preset.response_length + 8 * preset.response_length // 2)
    assert "| ours |" in (tmp_path / "grpo_step.md").read_text()
    # the first step's profile names the loop's stages (our systems only: not the variants' runs)
    profile = (tmp_path / "ours.first_step_profile.txt").read_text()
    assert "make_experience" in profile and "(train)" in profile
    assert not (tmp_path / "ours_mtpo.first_step_profile.txt").exists()
