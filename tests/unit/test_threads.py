"""A run starts as many compute threads as there are cores free for it (aligner_ext/threads.py), and
reward workers compute with one."""

import os
from pathlib import Path

import psutil
import pytest

from aligner_ext import threads
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.manager import RewardConfig, RewardManager


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_a_setting_wins(four_cores):
    assert threads.compute_threads(3) == 3


@pytest.mark.parametrize("load, expected", [([0.0, 5.0, 0.0, 2.0], 4), ([100.0, 0.0, 0.0, 0.0], 3),
                                            ([99.0, 97.0, 100.0, 100.0], 1)])
def test_cores_another_process_keeps_busy_are_left_to_it(four_cores, monkeypatch, load, expected):
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: load)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert threads.compute_threads(0) == expected


def test_torchrun_processes_split_the_cores_without_sampling(four_cores, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: pytest.fail("sampled under torchrun"))
    assert threads.compute_threads(0) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads.compute_threads(0) == 1


def test_a_reward_worker_computes_with_one_thread(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "rewards"))
    row = PromptRow(row_id="t:0", messages=[], data_source="threads")
    with RewardManager(RewardConfig(sources={"threads": "reward_helper_fns:torch_threads"}, num_workers=1)) as manager:
        [result] = manager.score(["x"], [row])
    assert result.score == 1.0 and result.info["omp"] == "1"
