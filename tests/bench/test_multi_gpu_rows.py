"""The rows of the multi-GPU table (scripts/bench/multi_gpu_rows.py) and the line a failed run is reported
with (multi_gpu.py), without running one: the presets name runnable rows, a bad row or name is one line
before any model is built."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from multi_gpu import failure_line, main, render  # noqa: E402
from multi_gpu_rows import PRESETS, ROWS, SHAPES, Layout, Row, named_rows  # noqa: E402


def test_the_presets_expand_in_order_without_repeating_a_row():
    rows = named_rows("1.5b-dp2,table-2gpu")
    assert [row.name for row in rows] == ["1.5b-dp2", "1.5b-1gpu", "1.5b-dp2-2x", "1.5b-tp2-sp", "8b-tp2-sp", "8b-pp2",
                                             "8b-tp2-sp-saves", "moe-ep2"]
    assert max(row.processes for row in named_rows("table-2gpu")) == 2
    assert max(row.processes for row in named_rows("table-4gpu")) == 4
    assert all(not ROWS[name].problem() for names in PRESETS.values() for name in names)


def test_a_layout_names_its_data_parallel_size_and_what_it_cannot_be():
    layout = Layout(4, tp=2, distributed_optimizer=True)
    assert layout.dp == 2 and layout.describe() == "4 GPUs: TP=2 + DP=2 + distributed optimizer"
    assert Layout(1).describe() == "1 GPU"
    assert Layout(4, pp=3).problem() == "TP=1 x PP=3 does not divide 4 processes"
    assert Layout(4, tp=2, ep=4).problem() == "EP=4 does not divide DP=2"
    assert Layout(1, sequence_parallel=True).problem() == "sequence parallelism needs TP > 1"


def test_a_row_that_cannot_run_is_refused_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"--rows 70b: no such row or preset; rows: 1.5b-1gpu, "):
        named_rows("70b")
    bad = Row("moe-packed", "moe", Layout(2, ep=2), prompts=1, n=1, steps=2)  # packed micro-batches at EP=2
    switched = Row("switched", "1.5b", Layout(2), prompts=1, n=1, steps=2, save=True,
                   resume=Layout(2, distributed_optimizer=True))
    monkeypatch.setitem(ROWS, bad.name, bad)
    monkeypatch.setitem(ROWS, switched.name, switched)
    with pytest.raises(ValueError, match=r"^row moe-packed: EP > 1 needs row micro-batches"):
        named_rows("moe-packed")
    with pytest.raises(ValueError, match=r"^row switched: a resume keeps use_distributed_optimizer"):
        named_rows("switched")


def test_a_failed_run_is_reported_with_the_librarys_line_else_the_exception():
    disk = ("INFO loading\n[rank1]: aligner-ext: error: /x/runs/8b: the run needs 210.0 GB for 2 checkpoint(s) "
            "(DiskSpaceError; ALIGNER_EXT_TRACEBACK=1 shows the traceback)\nE torchrun: ChildFailedError\n")
    assert failure_line(disk, 2) == ("exit 2: aligner-ext: error: /x/runs/8b: the run needs 210.0 GB for 2 "
                                     "checkpoint(s) (DiskSpaceError; ALIGNER_EXT_TRACEBACK=1 shows the traceback)")
    crash = ("Traceback (most recent call last):\n  File x\n[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n"
             "[rank1]: RuntimeError: NCCL communicator was aborted\n"
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n")
    assert failure_line(crash, 1) == "exit 1: torch.OutOfMemoryError: CUDA out of memory."
    assert failure_line(crash[crash.index("[rank1]"):], 1) == "exit 1: RuntimeError: NCCL communicator was aborted"
    torchrun_only = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    assert failure_line(torchrun_only, "ran past 900 s") == "exit ran past 900 s: no error line in the log"


def test_rows_past_the_budget_or_the_machine_are_reported_and_not_run(tmp_path):
    main(["--rows", "table-cpu", "--processes", "2", "--budget", "0", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "multi_gpu.json").read_text())["rows"]
    assert rows["tiny-tp2"]["skipped"] == "not started: less than 90 s of the call's --budget of 0 s was left"
    assert rows["tiny-moe-ep4"]["skipped"] == "skipped: needs 4 processes (--processes), this machine has 2"
    assert not (tmp_path / "work").exists() and not list(tmp_path.glob("*.log"))  # nothing built, nothing launched


def test_samples_per_second_are_a_multiple_of_the_one_gpu_row_of_the_same_batch_else_of_the_shape():
    def row(layout, batch, samples_per_s):
        return {"shape": "Qwen2.5-1.5B", "layout": layout, "batch": batch, "step_s": [1.0, 1.0, 1.0],
                "samples_per_s": samples_per_s, "generation_s": 0.5, "train_s": 0.5, "train_mfu": 0.5, "peak_gib": {},
                "checkpoint": {"bytes": 0, "optimizer": False, "write_s": 0, "mean_stall_per_save_s": None}}
    rows = {"one": row("1 GPU", "32 x 8", 40.0), "one-small": row("1 GPU", "16 x 8", 30.0),
            "same": row("2 GPUs: DP=2", "16 x 8", 45.0), "twice": row("2 GPUs: DP=2", "64 x 8", 76.0)}
    report = {"hardware": {"device_name": "cpu", "device": "cpu", "matmul": "float32", "matmul_flops_per_s": 1e12},
              "date": "today", "capacity": 2, "command": "run.py multi-gpu", "rows": rows}
    lines = {line.split(" | ")[0][2:]: line for line in render(report).splitlines() if line.startswith("| ")}
    assert "| 45.0 (1.50x) |" in lines["same"]  # against the one-GPU row of its batch: 45 / 30
    assert "| 76.0 (1.90x) |" in lines["twice"]  # no one-GPU row of 64 x 8: against the shape's first, 76 / 40
    assert "| 40.0 |" in lines["one"]


def test_a_run_cut_short_by_a_time_limit_reports_the_steps_it_trained(tmp_path, monkeypatch):
    """At 8B the final save alone can outlast a call: the steps before it are measured all the same."""
    import multi_gpu
    from families import shape
    from grpo_step_lib import Preset

    from aligner_ext.models.family_configs import family_config

    row = Row("cut", "tiny", Layout(2, tp=2), prompts=2, n=2, steps=4, save=True, variants=("dapo",),
              resume=Layout(1))
    preset = Preset("tiny", "words", 64, 2, 4, 2, 128, 512, prompts=1, n=1, prompt_length=16, response_length=8,
                    micro_batch=1, device="cpu", variant_steps=1)
    step_s = [9.0, 2.0, 4.0]  # three of four steps done, the first compiling

    def launch(name, processes, overrides, out, args, long_tail):
        assert name == "cut"  # neither the variant nor the resume runs after a cut
        (tmp_path / "runs" / "cut").mkdir(parents=True)
        lines = [{"step": step, "timing/step_s": seconds, "timing/train_s": seconds / 2, "timing/rollout_s": seconds / 4,
                  "batch/num_samples": 4, "response/length_mean": 8.0, "rollout/logprob_diff_mean": seconds / 1000}
                 for step, seconds in enumerate(step_s, 1)]
        lines.insert(0, {"step": 0, "val/accuracy": 0.5})  # the evaluation before training: no step trained
        (tmp_path / "runs" / "cut" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return "ran past 153 s", "SignalException: Process 5699 got signal: 15\n", {"0": {"resident": 1.0}}

    monkeypatch.setattr(multi_gpu, "launch", launch)
    monkeypatch.setattr(multi_gpu, "settings", lambda *args, **kwargs: [])  # no workspace: nothing is launched
    family, sizes = SHAPES["tiny"]
    model = shape(family_config(family, **sizes))
    result = multi_gpu.run_row(row, preset, model, tmp_path, tmp_path, None, matmul_rate=1e12)
    assert result["failed"] == ("cut short: ran past 153 s (--timeout or --budget), after 3 of 4 steps; "
                                "the final checkpoint not written")
    assert result["step_s"] == [3.0, 2.0, 4.0]  # steps 2 and 3: median, min, max
    assert result["samples_per_s"] == pytest.approx((4 / 2 + 4 / 4) / 2)
    assert result["samples_per_s_over_run"] == pytest.approx(8 / 6) and result["response_length_mean"] == 8.0
    assert result["train_s"] == pytest.approx(1.5) and result["checkpoint"]["bytes"] is None
    assert "variants" not in result and "resume" not in result
    report = {"hardware": {"device_name": "cpu", "device": "cpu", "matmul": "float32", "matmul_flops_per_s": 1e12},
              "date": "today", "capacity": 2, "command": "run.py multi-gpu", "rows": {"cut": result}}
    line = next(line for line in render(report).splitlines() if line.startswith("| cut |"))
    assert "| 3.00 [2.00, 4.00] |" in line and "| not written |" in line and line.endswith("not written |")
    assert "- cut: 9.00 (2.25 + 4.50), 2.00 (0.50 + 1.00), 4.00 (1.00 + 2.00)" in render(report)  # every step's phases
    assert result["logprob_gap"] == pytest.approx(0.003)  # steps 2 and 3's 0.002 and 0.004, not the first's 0.009
    assert "- cut: 0.00300" in render(report)


def test_a_long_tailed_row_makes_the_loops_engine_long_tailed_as_it_is_built(monkeypatch):
    """MULTI_GPU_LONG_TAIL=responses (a row's long_tail): of 20 responses of up to 8 tokens, 2 (10%) run to 8 and the
    others stop at 8 / 8 = 1, the long ones chosen by the call's seed, the same on every rank."""
    from types import SimpleNamespace

    from multi_gpu_rank import long_tailed_engine

    from aligner_ext.generation.base import GenerationOutput, SamplingParams
    from aligner_ext.trainer import loop

    class Engine:
        weights_version = 0

        def generate(self, prompts, params):
            return [GenerationOutput(token_ids=[5] * params.max_new_tokens, finish_reason="length") for _ in prompts]

    monkeypatch.setattr(loop, "build_components", lambda cfg, run_dir: SimpleNamespace(engine=Engine()))
    long_tailed_engine("responses")
    lengths = [[len(o.token_ids) for o in loop.build_components(None, None).engine.generate(
        [[1, 2]] * 20, SamplingParams(max_new_tokens=8, seed=seed))] for seed in (3, 3, 4)]
    assert sorted(lengths[0]) == [1] * 18 + [8] * 2
    assert lengths[0] == lengths[1] != lengths[2]  # the seed picks which responses are long


def test_a_row_long_tailed_by_prompt_makes_each_engine_built_long_tailed_by_prompt(monkeypatch):
    """MULTI_GPU_LONG_TAIL=prompts: the engine each rank's split drives (trainer/build.py::build_engine) makes a
    prompt's responses all 16 tokens or all 16 / 8 = 2, by its tokens, about 10% of the prompts long."""
    from multi_gpu_rank import long_tailed_engine

    from aligner_ext.generation.base import GenerationOutput, SamplingParams
    from aligner_ext.trainer import build

    class Engine:
        def generate(self, prompts, params, caps=None):
            return [GenerationOutput(token_ids=[5] * cap, finish_reason="length") for cap in caps]

    monkeypatch.setattr(build, "build_engine", lambda *args: Engine())
    long_tailed_engine("prompts")
    engine = build.build_engine(None, "rollout", None, None)
    prompts = [[index, index + 1] for index in range(300)] * 2  # each prompt twice: both times the same length
    lengths = [len(output.token_ids) for output in engine.generate(prompts, SamplingParams(max_new_tokens=16))]
    assert set(lengths) == {2, 16} and lengths[:300] == lengths[300:]
    assert 0.05 < lengths[:300].count(16) / 300 < 0.15


def test_a_run_whose_prompts_were_not_the_workloads_is_a_failure_and_its_mfu_counts_the_real_prompts(
        tmp_path, monkeypatch):
    """A tokenizer that encoded the rows otherwise (the 3-token prompts of a qwen2-shaped checkpoint's word
    tokenizer) made a row's figures those of another workload."""
    import multi_gpu
    from families import shape
    from grpo_step_lib import Preset

    from aligner_ext.models.family_configs import family_config

    row = Row("short", "tiny", Layout(1), prompts=2, n=2, steps=3)
    preset = Preset("tiny", "words", 64, 2, 4, 2, 128, 512, prompts=1, n=1, prompt_length=16, response_length=8,
                    micro_batch=1, device="cpu", variant_steps=1)

    def launch(name, processes, overrides, out, args, long_tail):
        (tmp_path / "runs" / name).mkdir(parents=True)
        lines = [{"step": step, "timing/step_s": 2.0, "timing/train_s": 1.0, "timing/rollout_s": 1.0,
                  "batch/num_samples": 4, "response/length_mean": 8.0, "prompt/length_mean": 3.0} for step in (1, 2, 3)]
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return 0, "", {"0": {"resident": 1.0}}

    monkeypatch.setattr(multi_gpu, "launch", launch)
    monkeypatch.setattr(multi_gpu, "settings", lambda *args, **kwargs: [])
    model = shape(family_config(*SHAPES["tiny"][:1], **SHAPES["tiny"][1]))
    result = multi_gpu.run_row(row, preset, model, tmp_path, tmp_path, None, matmul_rate=1e12)
    assert result["failed"] == ("its prompts were 3 tokens, not the workload's 16: the tokenizer did not encode "
                                "the rows as they were written")
    # 4 sequences of 3 + 8 tokens (8 trained), 1 s of training at 1e12 FLOP/s: the FLOPs of 11-token sequences
    expected = multi_gpu.train_flops(model, [11.0] * 4, [8.0] * 4) / 1.0 / 1e12
    assert result["train_mfu"] == pytest.approx(expected)
    assert expected < multi_gpu.train_flops(model, [24.0] * 4, [8.0] * 4) / 1e12  # not the workload's 16 + 8
