"""The family benchmark (`run.py families`, scripts/bench/families.py): its decode bound and training FLOPs by hand
(windowed layers count their window only), a refusal reported in the table, and a run of two
families at the tiny size on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")  # the tiny run trains on the Megatron backend too: in .venv312 (tests/megatron_env.py)

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from families import decode_bound_s, render, train_flops  # noqa: E402

# two layers, the second windowed to 4 positions; 10 K+V values per token and layer
MODEL = {"body_matmul_params": 1000, "head_params": 200, "heads": 2, "head_dim": 3,
         "kv_values_per_token_per_layer": 10, "windows": [None, 4]}


def test_decode_bound_by_hand():
    # B = 2, P = 3, R = 2, 4-byte words, 1e4 bytes/s; step t reads the weights (1200 x 4 bytes) and per
    # sequence 40 bytes per cached position: t = 1: 4 + min(4, 4); t = 2: 5 + min(5, 4)
    expected = (2 * 4800 + 2 * 40 * (4 + 4) + 2 * 40 * (5 + 4)) / 1e4
    assert decode_bound_s(MODEL, 2, 3, 2, 4, 1e4) == pytest.approx(expected)


def test_train_flops_by_hand():
    # one sequence of 5 tokens, 2 of them response: attention 12 x 2 x 3 x 5 x (5 + min(5, 4))
    assert train_flops(MODEL, [5], [2]) == 6 * 1000 * 5 + 6 * 200 * 2 + 72 * 5 * 9


def test_a_refusal_is_a_note_of_the_table_not_a_crash():
    report = {"date": "d", "hardware": {"device_name": "gpu", "matmul": "m", "matmul_flops_per_s": 1e15,
                                        "copy_bytes_per_s": 3e12},
              "workload": {"prompts": 8, "n": 8, "prompt_length": 128, "response_length": 256},
              "families": {"olmo2": {"auto_engine": "hf", "rollout_refusal": "OLMo 2 (olmo2): rollout line",
                                     "params": 1.2e9, "grpo_error": "a failure line",
                                     "megatron_error": "OLMo 2 (olmo2): megatron line"}}}
    table = render(report)
    assert "| olmo2 | 1.20B | hf [1] | not run [2] | - | - | not run [3] | - | - | - |" in table
    assert table.endswith("[1] OLMo 2 (olmo2): rollout line\n[2] a failure line\n[3] OLMo 2 (olmo2): megatron line")


@pytest.mark.slow
def test_two_families_at_the_tiny_size_on_the_cpu(tmp_path):
    command = [sys.executable, str(BENCH / "run.py"), "families", "--tiny", "--families", "gemma3_text,phi3",
               "--warmup", "0", "--steps", "1", "--megatron-warmup", "0", "--megatron-steps", "1", "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    report = json.loads((tmp_path / "result.json").read_text())["report"]
    assert list(report["families"]) == ["gemma3_text", "phi3"]
    for name, summary in report["families"].items():
        assert summary["auto_engine"] == "hf"  # the rollout engine runs on GPUs only
        assert summary["decode_tokens_per_s"] > 0 and summary["hf_train_mfu"] > 0 and summary["megatron_train_mfu"] > 0
        raw = json.loads((tmp_path / f"{name}.json").read_text())
        [step] = raw["grpo"]["steps"]
        assert step["generated_tokens"] == 2 * 2 * 8  # prompts x n x R, EOS ignored
        assert len(raw["megatron"]["calls"]) == 1
    # gemma's released pattern at 2 layers: the first windowed (512), the second global
    assert json.loads((tmp_path / "gemma3_text.json").read_text())["model"]["windows"] == [512, None]
    assert "| phi3 |" in (tmp_path / "families.md").read_text()
