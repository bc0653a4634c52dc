"""The Megatron family benchmark (`run.py megatron`, scripts/bench/megatron_families.py): a before / after run of one
family at the tiny size on the CPU (this tree on both sides), with the profile of a train call."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"


@pytest.mark.slow
def test_one_family_before_and_after_at_the_tiny_size_on_the_cpu(tmp_path):
    command = [sys.executable, str(BENCH / "run.py"), "megatron", "--tiny", "--families", "olmo2", "--steps", "1",
               "--warmup", "1", "--profile", "--prev", str(ROOT), "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    report = json.loads((tmp_path / "megatron_families.json").read_text())
    assert list(report["families"]) == ["prev:olmo2", "olmo2"]
    after, before = report["families"]["olmo2"], report["families"]["prev:olmo2"]
    assert after["train_mfu"] > 0 and before["train_mfu"] > 0
    assert before["profile"] is None  # the earlier side is timed only
    profile = after["profile"]
    assert profile["busy_s"] > 0 and profile["top"] and sum(profile["kinds_s"].values()) == pytest.approx(profile["busy_s"])
    table = (tmp_path / "megatron_families.md").read_text()
    assert "| olmo2 | earlier |" in table and "| olmo2 | this |" in table
    assert (tmp_path / "olmo2.profile.txt").read_text().startswith("olmo2: one train call")
