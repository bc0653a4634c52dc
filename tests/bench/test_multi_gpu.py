"""The multi-GPU table (`run.py multi-gpu`, scripts/bench/multi_gpu.py) on the CPU: the preset `table-cpu` at 2
processes (gloo, float32) runs its tiny TP=2 row under torchrun, resumes the row's checkpoint in 1 process at
TP=1, and skips its 4-process row with the line that says why. The GPU rows are the same code at real shapes
(docs/benchmarks.md, "Multi-GPU table")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_cpu_table_runs_a_row_resumes_it_at_another_layout_and_skips_one(tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "bench" / "run.py"), "multi-gpu", "--rows", "table-cpu",
               "--processes", "2", "--timeout", "300", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "result.json").read_text())["report"]["rows"]
    assert list(rows) == ["tiny-tp2", "tiny-moe-ep4"]
    assert rows["tiny-moe-ep4"]["skipped"] == "skipped: needs 4 processes (--processes), this machine has 2"
    row = rows["tiny-tp2"]
    assert "failed" not in row, row
    assert row["layout"] == "2 GPUs: TP=2" and row["dp"] == 1
    assert set(row["peak_gib"]) == {"0", "1"} and all(p["resident"] > 0.1 for p in row["peak_gib"].values())
    assert len(row["steps_s"]) == 2  # the first step is left out of the median: one step timed
    assert row["step_s"] == [row["steps_s"][1]] * 3
    assert row["samples_per_s"] * row["step_s"][0] == pytest.approx(2 * 2)  # prompts x samples per step
    assert 0 < row["train_s"] < row["step_s"][0] and 0 < row["generation_s"] < row["step_s"][0]
    assert row["train_mfu"] > 0
    checkpoint = row["checkpoint"]
    assert checkpoint["optimizer"] and checkpoint["bytes"] > 0 and checkpoint["write_s"] > 0
    resumed = row["resume"]
    assert "failed" not in resumed, resumed
    assert resumed["layout"] == "1 GPU" and set(resumed["peak_gib"]) == {"0"}
    assert resumed["resumed_from_step"] == 2 and resumed["step_s"] > 0  # loaded step 2, then trained step 3
    table = (tmp_path / "multi_gpu.md").read_text()
    assert "| tiny-tp2 | tiny, 2 GPUs: TP=2 |" in table and "1 GPU: from step 2" in table
    assert "skipped: needs 4 processes" in table
