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
