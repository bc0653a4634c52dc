"""Logging under torchrun: one stream of INFO lines (rank 0), warnings from every rank, rank-tagged; and
transformers' progress bar per checkpoint hidden, the downloads' bars kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SNIPPET = (
    "import logging; from aligner_ext.cli import configure_logging; configure_logging('INFO'); "
    "log = logging.getLogger('aligner_ext.probe'); log.info('progress line'); log.warning('a warning')"
)


def run_snippet(env_update: dict[str, str], snippet: str = SNIPPET) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_update)
    return subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=60)


def test_single_process_logs_info_without_rank_tag():
    result = run_snippet({})
    assert result.returncode == 0, result.stderr
    assert "INFO aligner_ext.probe: progress line" in result.stderr
    assert "WARNING aligner_ext.probe: a warning" in result.stderr
    assert "[rank" not in result.stderr


def test_rank_zero_of_two_logs_info_with_its_tag():
    result = run_snippet({"RANK": "0", "WORLD_SIZE": "2"})
    assert result.returncode == 0, result.stderr
    assert "[rank 0] INFO aligner_ext.probe: progress line" in result.stderr
    assert "[rank 0] WARNING aligner_ext.probe: a warning" in result.stderr


def test_other_ranks_log_only_warnings():
    result = run_snippet({"RANK": "1", "WORLD_SIZE": "2"})
    assert result.returncode == 0, result.stderr
    assert "progress line" not in result.stderr
    assert "[rank 1] WARNING aligner_ext.probe: a warning" in result.stderr


def test_debug_on_rank_one_still_stops_at_warnings():
    snippet = SNIPPET.replace("configure_logging('INFO')", "configure_logging('debug')")
    result = run_snippet({"RANK": "1", "WORLD_SIZE": "2"}, snippet)
    assert result.returncode == 0, result.stderr
    assert "progress line" not in result.stderr and "a warning" in result.stderr


@pytest.mark.parametrize("level", ["loud", "20"])
def test_unknown_level_is_named(level):
    result = run_snippet({}, SNIPPET.replace("'INFO'", repr(level)))
    assert result.returncode != 0
    assert f"unknown --log-level {level!r}" in result.stderr



BARS = ("from aligner_ext.cli import hide_checkpoint_bars; hide_checkpoint_bars(); "
        "from transformers.utils import logging; from huggingface_hub.utils import are_progress_bars_disabled; "
        "print('checkpoint bars', logging.is_progress_bar_enabled(), 'download bars', not are_progress_bars_disabled())")


@pytest.mark.parametrize("user_setting, expected", [
    (None, "checkpoint bars False download bars True"),  # the downloads' bars kept
    ("1", "checkpoint bars False download bars False"),
    ("0", "checkpoint bars True download bars True"),
])
def test_checkpoint_bars_are_hidden_unless_the_user_set_hugging_face_bars(monkeypatch, user_setting, expected):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    result = run_snippet({} if user_setting is None else {"HF_HUB_DISABLE_PROGRESS_BARS": user_setting}, BARS)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
    assert "progress bars" not in result.stderr  # huggingface_hub warns where a call goes against the setting
