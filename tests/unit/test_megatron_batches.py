"""How the test modules that run in .venv312 are packed into processes (tests/megatron_env.py::packed)."""

from pathlib import Path

import megatron_env
from megatron_env import packed


def test_modules_are_packed_first_fit_longest_first_under_the_bound(monkeypatch):
    monkeypatch.setattr(megatron_env, "SECONDS_IN_CI", {"a.py": 160, "b.py": 100, "c.py": 60, "d.py": 45, "e.py": 30})
    monkeypatch.setattr(megatron_env, "DEFAULT_SECONDS", 20)
    monkeypatch.setattr(megatron_env, "BATCH_SECONDS", 150)
    paths = [Path(f"tests/{name}") for name in ("e.py", "unlisted.py", "a.py", "c.py", "b.py", "d.py")]
    # by hand, longest first: a (160) alone; b (100) opens a group, c (60) does not fit it (160); d (45)
    # joins b (145); e (30) joins c (90); unlisted (20) joins c (110)
    assert [[path.name for path in group] for group in packed(paths)] == [
        ["a.py"], ["b.py", "d.py"], ["c.py", "e.py", "unlisted.py"]]


def test_a_failed_batch_reports_its_first_traceback_not_only_the_summary_lines():
    output = ("...E\n==================== ERRORS ====================\n___ ERROR at setup of test_a ___\n"
              "RuntimeError: the worker could not start\n___ ERROR at setup of test_b ___\nsame\n"
              "=== short test summary info ===\n" + "ERROR tests/x.py::test_b\n" * 300)
    report = megatron_env.first_report(output, limit=120)
    assert report.startswith("= ERRORS =") and "RuntimeError: the worker could not start" in report
    assert len(report) == 120 and megatron_env.first_report("1 passed") == ""
