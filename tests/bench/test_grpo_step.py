"""The GRPO-step benchmark (`run.py grpo`, scripts/bench/grpo_step.py): its bounds, its phase accounting,
the long-tailed workload, the asynchronous report, and small runs of our side on the CPU (TRL is not
installed in CI; the side by side is in docs/benchmarks.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import grpo_step_ours  # noqa: E402
from grpo_step import (baseline_memory, floors, memory_growth_lines, overlap, overlap_lines, ratio_lines,  # noqa: E402
                        with_ahead_runs)
from grpo_step_lib import PRESETS, LongTail, LongTailByPrompt, PhaseClock, Preset, prompt_ids, write_workspace  # noqa: E402

from aligner_ext.generation.base import GenerationOutput, SamplingParams  # noqa: E402


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


def test_floors_count_each_response_length():
    # as test_floors_by_hand, but one response of R = 2 tokens and three of 1
    preset = Preset("t", "char", 8, 2, 2, 1, 16, 0, prompts=2, n=2, prompt_length=3, response_length=2,
                    micro_batch=4, device="cpu", variant_steps=1)
    model = {"layers": 2, "hidden": 8, "body_matmul_params": 1000, "head_params": 200, "kv_values_per_token": 10}
    floor = floors(preset, {"model": model, "copy_bytes_per_s": 1e4, "matmul_flops_per_s": 1e6}, [2, 1, 1, 1])
    # step 1 reads the weights and 4 sequences x 4 tokens of K/V; step 2 the weights and 1 x 5
    assert floor["decode_bound_s"] == pytest.approx((4800 + 4 * 4 * 40 + 4800 + 5 * 40) / 1e4)
    # a 1-token response: 6 x 1000 x 4 + 6 x 200 x 1 + 12 x 2 x 8 x 16 = 24000 + 1200 + 3072
    assert floor["train_flops"] == 37200 + 3 * 28272
    assert floor["generated_tokens"] == 5


class CountingEngine:
    """Each response continues its prompt: token i of the sequence is i, its log-prob -i."""

    weights_version = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(([list(prompt) for prompt in prompts], params.max_new_tokens))
        return [GenerationOutput(token_ids=list(range(len(prompt), len(prompt) + params.max_new_tokens)),
                                 finish_reason="length", logprobs=[-float(i) for i in range(len(prompt), len(prompt)
                                                                                          + params.max_new_tokens)])
                for prompt in prompts]


def test_a_tenth_of_the_responses_runs_8x_the_median():
    engine = CountingEngine()
    LongTail(engine)
    prompts = [[index] * 3 for index in range(20)]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16, seed=5, return_logprobs=True))
    lengths = [len(output.token_ids) for output in outputs]
    assert sorted(lengths) == [2] * 18 + [16] * 2  # 10% of 20 run to R = 16, the others to 16 / 8
    long = [index for index, length in enumerate(lengths) if length == 16]
    # made as two calls: all 20 to the median, then the long ones continued from where they stood
    (first, median), (second, rest) = engine.calls
    assert first == prompts and median == 2 and rest == 14
    assert second == [prompts[index] + [3, 4] for index in long]
    assert outputs[long[0]].token_ids == list(range(3, 19)) and outputs[long[0]].logprobs == [-float(i) for i in range(3, 19)]
    # the step's seed draws the long rows: the same in every system, other rows at another step
    again = CountingEngine()
    LongTail(again)
    assert [len(o.token_ids) for o in again.generate(prompts, SamplingParams(max_new_tokens=16, seed=5))] == lengths
    other = [len(o.token_ids) for o in again.generate(prompts, SamplingParams(max_new_tokens=16, seed=6))]
    assert sorted(other) == sorted(lengths) and other != lengths


class CappedEngine:
    """Answers each request with tokens 1, 2, ... up to its cap ("length"), as random weights do; records the caps."""

    def __init__(self):
        self.caps = []

    def generate(self, prompts, params, caps=None, on_finished=None):
        self.caps.append(caps)
        return [GenerationOutput(token_ids=list(range(1, cap + 1)), finish_reason="length") for cap in caps]


def test_the_long_tail_by_prompt_keeps_a_resumed_responses_length():
    """A prompt's responses are all long or all short, by its P tokens; a response resumed from 3 tokens (the
    prompt followed by them) is capped at what its length leaves and ends there ("stop")."""
    engine = CappedEngine()
    LongTailByPrompt(engine, prompt_length=3)
    prompts = [[index] * 3 for index in range(200)]
    lengths = [len(output.token_ids) for output in engine.generate(prompts, SamplingParams(max_new_tokens=16))]
    assert set(lengths) == {2, 16} and 0.05 < lengths.count(16) / 200 < 0.15  # LONG_SHARE of the prompts
    long = [prompt for prompt, length in zip(prompts, lengths) if length == 16]
    caps = [16, 5] * (len(long) // 2) + [16] * (len(long) % 2)  # a carried-over call's own caps, some below 13
    outputs = engine.generate([prompt + [7, 8, 9] for prompt in long], SamplingParams(max_new_tokens=16), caps=caps)
    assert engine.caps[1] == [min(13, cap) for cap in caps]
    assert [(len(output.token_ids), output.finish_reason) for output in outputs] == [
        (13, "stop") if cap == 16 else (5, "length") for cap in caps]  # ended at its length, or cut by the call
    assert [len(output.token_ids) for output in engine.generate(prompts, SamplingParams(max_new_tokens=16))] == lengths


def test_the_long_tail_by_prompt_through_an_engine_without_caps_is_two_calls():
    """A server's engine takes no per-request caps: every prompt to the median, then the long prompts' responses
    continued to R, the same prompts long as with caps."""
    prompts = [[index] * 3 for index in range(200)]
    capped = CappedEngine()
    LongTailByPrompt(capped, prompt_length=3)
    expected = [len(output.token_ids) for output in capped.generate(prompts, SamplingParams(max_new_tokens=16))]
    engine = CountingEngine()
    LongTailByPrompt(engine, prompt_length=3)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [len(output.token_ids) for output in outputs] == expected
    long = [index for index, length in enumerate(expected) if length == 16]
    (first, median), (second, rest) = engine.calls
    assert first == prompts and median == 2 and rest == 14 and second == [prompts[index] + [3, 4] for index in long]
    assert outputs[long[0]].token_ids == list(range(3, 19))  # the tail continues the response


class RefittedEngine(CountingEngine):
    """The first call samples at version 4 (its outputs carry no versions) and ends with a refit to 5; the
    second, a long response's tail, is parked once after its first token (versions 4, 5, 5, ...)."""

    weights_version = 4

    def generate(self, prompts, params):
        outputs = super().generate(prompts, params)
        if len(self.calls) == 2:
            for output in outputs:
                output.versions = [4] + [5] * (len(output.token_ids) - 1)
        self.weights_version = 5
        return outputs


def test_a_long_response_keeps_each_parts_versions():
    """With partial rollouts the weights may change between the two parts of a long response: each part's
    tokens keep the version that sampled them, one per token (a list as long as the response)."""
    engine = RefittedEngine()
    LongTail(engine)
    outputs = engine.generate([[index] * 3 for index in range(20)], SamplingParams(max_new_tokens=16, seed=5))
    long = [output for output in outputs if len(output.token_ids) == 16]
    assert len(long) == 2 and all(output.versions == [4, 4] + [4] + [5] * 13 for output in long)
    assert all(output.versions is None for output in outputs if len(output.token_ids) == 2)


def test_overlap_of_the_measured_steps():
    def step(step_s, generation_s, wait_s, metrics):
        return {"step_s": step_s, "generation_s": generation_s, "trainer_wait_s": wait_s,
                "phases_s": {"train": step_s / 2}, "metrics": {"response/length_mean": 2 * step_s, **metrics}}

    synchronous = [step(4.0, 1.0, 1.5, {"staleness/share_lag_0": 1.0}), step(6.0, 3.0, 3.5, {"staleness/share_lag_0": 1.0}),
                   step(5.0, 2.0, 2.5, {"staleness/share_lag_0": 1.0})]
    o = overlap(synchronous, 10, ahead=False)
    # medians: step 5 s, so 10 / 5 samples/s; the generator is idle for the step's rest, 2.5 s of each
    assert (o["samples_per_s"], o["generation_s"], o["train_s"], o["trainer_wait_s"], o["generator_idle_s"]) == \
        (2.0, 2.0, 2.5, 2.5, 2.5)
    # over the run: 30 samples in 15 s; the responses' length averaged over the steps (8, 12, 10 tokens)
    assert (o["samples_per_s_over_run"], o["response_length_mean"]) == (2.0, 10.0)
    ahead = [step(2.0, 1.0, 0.1, {"async/generator_idle_s": 0.4, "staleness/mean": 1.0, "staleness/max": 1.0,
                                  "staleness/share_lag_1": 1.0, "rollout/logprob_diff_mean_lag_1": 0.03}),
             step(2.0, 1.0, 0.1, {"async/generator_idle_s": 0.6, "staleness/mean": 0.5, "staleness/max": 1.0,
                                  "staleness/share_lag_0": 0.5, "staleness/share_lag_1": 0.5,
                                  "rollout/logprob_diff_mean_lag_0": 0.01, "rollout/logprob_diff_mean_lag_1": 0.05})]
    o = overlap(ahead, 10, ahead=True)
    assert o["generator_idle_s"] == pytest.approx(0.5)  # the thread's wait for admission
    assert o["samples_per_s_over_run"] == 5.0
    # shares averaged over the steps (a lag absent from a step counts 0 there); gaps over the steps that have the lag
    assert o["staleness"] == {"mean": 0.75, "max": 1.0, "share_by_lag": {"0": 0.25, "1": 0.75},
                              "logprob_gap_by_lag": {"0": 0.01, "1": pytest.approx(0.04)}}


def test_asynchronous_against_synchronous():
    def overlap(asynchronous, samples_per_s, step_s, generation_s, wait_s, idle_s, staleness, shares, gaps):
        return {"overlap": {"asynchronous": asynchronous, "samples_per_s": samples_per_s, "step_s": step_s,
                            "generation_s": generation_s, "train_s": 4.0, "trainer_wait_s": wait_s,
                            "generator_idle_s": idle_s, "staleness": {"mean": staleness, "max": 1.0,
                                                                       "share_by_lag": shares,
                                                                       "logprob_gap_by_lag": gaps}}}

    systems = {"ours_rollout": overlap(False, 40.0, 6.4, 2.0, 2.4, 4.0, 0.0, {"0": 1.0}, {"0": 0.01}),
               "ours_rollout_async_k1": overlap(True, 50.0, 5.12, 2.5, 0.6, 1.0, 0.75, {"0": 0.25, "1": 0.75},
                                                {"0": 0.01, "1": 0.03}),
               "ours_async_k1": overlap(True, 20.0, 0.5, 1.0, 0.5, 0.5, 1.0, {"1": 1.0}, {})}
    systems["ours_rollout_async_k1"]["overlap"]["synchronous"] = "ours_rollout"
    systems["ours_async_k1"]["overlap"]["synchronous"] = "ours"  # not run here
    lines = overlap_lines(systems)
    # the synchronous run, then the asynchronous one with its ratios to it (50 / 40, 5.12 / 6.4, ...);
    # `ours_async_k1` has no synchronous run to compare with
    assert lines[-2] == "| ours_rollout | 40.0 | 6.40 | 2.00 | 4.00 | 2.40 | 4.00 | 0.00 / 1 | 0: 100% | 0: 0.0100 |"
    assert lines[-1] == ("| ours_rollout_async_k1 | 50.0 (1.25x) | 5.12 (0.80x) | 2.50 (1.25x) | 4.00 (1.00x) "
                         "| 0.60 (0.25x) | 1.00 (0.25x) | 0.75 / 1 | 0: 25%, 1: 75% | 0: 0.0100, 1: 0.0300 |")
    assert len(lines) == 7 and overlap_lines({"ours_async_k1": systems["ours_async_k1"]}) == []


@pytest.mark.slow
def test_generation_ahead_on_the_long_tail_on_the_cpu(tmp_path):
    preset = PRESETS["tiny"]  # 4 prompts x n = 8, R = 64
    write_workspace(preset, 3 * preset.prompts, tmp_path)
    out = tmp_path / "ours_async_k1.json"
    grpo_step_ours.main(["--workspace", str(tmp_path), "--out", str(out), "--warmup", "1", "--steps", "1",
                         "--long-tail", "--set", "trainer.asynchronous.enabled=true",
                         "--set", "trainer.asynchronous.max_staleness=1"])
    steps = json.loads(out.read_text())["steps"]
    assert len(steps) == 2
    for step in steps:
        # each step's batch, made in the maker's thread: round(0.1 x 32) = 3 responses of 64 tokens, 29 of 8
        (call,) = step["generate_calls"]
        assert sorted(call["lengths"]) == [8] * 29 + [64] * 3
        assert step["generation_s"] > 0 and step["trainer_wait_s"] >= 0
        # generated ahead (the trainer's clock has no generation), never more than 1 version behind
        assert "generation" not in step["phases_s"] and "async/generator_idle_s" in step["metrics"]
        assert step["metrics"]["staleness/max"] <= 1
    assert steps[0]["metrics"]["staleness/max"] == 0  # the first batch: nothing trained before it


@pytest.mark.slow
def test_the_disaggregated_placement_on_the_cpu(tmp_path):
    """Generation ahead through `aligner-ext serve` in a process of its own (--serve-on; the second GPU's
    part of `--disaggregated`), on the long tail: the server made every batch, the weights pushed to it."""
    preset = PRESETS["tiny"]  # 4 prompts x n = 8
    write_workspace(preset, 3 * preset.prompts, tmp_path)
    out = tmp_path / "ours_rollout_served_async_k1.json"
    grpo_step_ours.main(["--workspace", str(tmp_path), "--out", str(out), "--warmup", "1", "--steps", "1",
                         "--engine", "rollout", "--serve-on", "cpu", "--long-tail", "--set", "rollout.max_response_length=16",
                         "--set", "trainer.asynchronous.enabled=true", "--set", "trainer.asynchronous.max_staleness=1"])
    result = json.loads(out.read_text())
    assert "generator.engine=remote" in result["settings"]["overrides"]
    steps = result["steps"]
    assert [step["metrics"]["staleness/max"] for step in steps] == [0, 1]  # the second batch made while step 1 trained
    for step in steps:
        (call,) = step["generate_calls"]  # the long tail's two requests, as one engine call: R = 16, the median 2
        assert sorted(call["lengths"]) == [2] * 29 + [16] * 3
        assert "generation" not in step["phases_s"] and step["metrics"]["async/refit_s"] >= 0
    assert (tmp_path / "ours_rollout_served_async_k1.server" / "server.log").exists()


def test_each_of_our_systems_runs_ahead_through_a_server_and_on_the_second_gpu_too():
    assert with_ahead_runs("ours_rollout", [1], [1, 2], [1]) == [
        "ours_rollout", "ours_rollout_async_k1", "ours_rollout_served", "ours_rollout_served_async_k1",
        "ours_rollout_served_async_k2", "ours_rollout_gpu1_async_k1"]
    assert with_ahead_runs("ours", [], [], []) == ["ours"]
    assert with_ahead_runs("trl_fast", [1], [1], [1]) == ["trl_fast"]
    assert with_ahead_runs("prev:ours", [1], [1], [1]) == ["prev:ours"]  # generation ahead is this tree's
    assert with_ahead_runs("ours_packed_gpu1_async_k1", [1], [], [1]) == ["ours_packed_gpu1_async_k1"]  # named whole


def test_memory_that_grows_at_every_step_is_reported_with_its_rate():
    def steps(quietest):  # step 0 allocates the run's state; each step's phases peak above its quietest
        return [{"peak_gib": {"rewards": low, "train": low + 20.0}} for low in quietest]

    # the GPU runs that kept each call's KV cache: 5.25 GiB more at every step (docs/benchmarks.md)
    leaking = {"baseline_gib": baseline_memory(steps([14.0, 36.5, 41.75, 47.0, 52.25]))}
    flat = {"baseline_gib": baseline_memory(steps([14.0, 36.5, 36.6, 36.5, 36.6]))}
    lines = memory_growth_lines({"ours": leaking, "ours_packed": flat, "trl_fast": {}})
    assert lines[1] == "Memory that grew at every step:"
    assert lines[3:] == ["- ours: the allocated memory grew at every step, 5.25 GiB a step (36.5 to 52.2 GiB at each "
                         "step's quietest phase): each step leaves something allocated"]
    assert memory_growth_lines({"ours": flat}) == []
    assert baseline_memory([{"peak_gib": {}}, {}]) == []  # the CPU records no peaks


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
               "--variants", "mtpo", "--warmup", "0", "--steps", "1", "--variant-steps", "1", "--profile-first-step",
               "--torch-profile", "train", "--prev", str(BENCH.parents[1]), "--out", str(tmp_path)]
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
