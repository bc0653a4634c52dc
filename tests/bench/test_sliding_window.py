"""The sliding-window benchmark (`run.py sliding-window`, scripts/bench/sliding_window.py) at the tiny size on the CPU, in
float32: sequences several windows long, the Megatron forward and both rollout engines equal
transformers' windowed model, and lifting the window moves the log-probs far outside that."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.mark.slow
def test_windows_bite_and_agree_at_the_tiny_size_on_the_cpu(tmp_path):
    command = [sys.executable, str(BENCH / "run.py"), "sliding-window", "--tiny", "--families", "gemma3_text,mistral",
               "--steps", "1", "--repeats", "1", "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)  # exit 1 on any FAIL line
    report = json.loads((tmp_path / "sliding_window.json").read_text())
    for name in ("gemma3_text", "mistral"):
        result = report["families"][name]
        assert result["window"] == 8 and sum(result["work"]["train"][1:]) > 4 * result["window"]
        forward = result["forward"]
        for key in ("megatron_packed", "megatron_rows"):
            assert forward[key]["max"] < 1e-4  # float32: rounding only
        assert forward["control_window_lifted"]["mean"] > 1e-2
        for engine in ("hf_decoder", "megatron_decoder"):
            rollout = result["rollout"][engine]
            assert rollout["logprob_error"]["max"] < 1e-4 and rollout["argmax_agreement"] == 1.0
        assert set(result["training"]) == {"windowed", "lifted"}
    assert report["families"]["mistral"]["windows"] == [8, 8]
    assert report["families"]["gemma3_text"]["windows"] == [8, None]
    assert "PASS mistral rollout megatron_decoder" in (tmp_path / "sliding_window.md").read_text()
