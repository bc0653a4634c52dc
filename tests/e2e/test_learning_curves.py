"""scripts/learning_curves.py (docs/learning.md's generator) end to end on its --quick preset, one task:
both methods train, the page gets a row per method with before → after values taken from the runs'
metrics, and the figure is written; a second call reuses the finished runs instead of training again."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "learning_curves.py"


@pytest.mark.slow
def test_quick_preset_writes_the_page_and_reuses_runs(tmp_path):
    command = [sys.executable, str(SCRIPT), "--quick", "--only", "rubric_qa", "--seeds", "0",
               "--runs-dir", str(tmp_path / "runs"), "--doc", str(tmp_path / "learning.md")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    page = (tmp_path / "learning.md").read_text()
    assert (tmp_path / "learning" / "rubric_qa.png").stat().st_size > 10_000
    for method, directory in (("GRPO", "GRPO"), ("graded prompt", "graded_prompt")):
        metrics = [json.loads(line) for line in
                   (tmp_path / "runs" / "rubric_qa" / directory / "seed0" / "metrics.jsonl").read_text().splitlines()]
        held_out = [record["val/reward_mean"] for record in metrics if "val/reward_mean" in record]
        assert len(held_out) == 3  # steps 0, 1 and 2 of the quick preset
        row = next(line for line in page.splitlines() if line.startswith(f"| {method} |"))
        assert f"{held_out[0]:.3f} → {held_out[-1]:.3f} ± 0.000" in row
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0 and "seed 0:" not in again.stdout  # nothing trained the second time
