"""Logging under torchrun: one stream of INFO lines (rank 0), warnings from every rank, rank-tagged."""

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
