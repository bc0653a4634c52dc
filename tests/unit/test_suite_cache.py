"""The test suite's own warm-up cache (tests/conftest.py, $ALIGNER_EXT_CACHE): made once, by the process that
finds the variable unset, and removed when that process exits; a process that finds it set (a pytest worker, a
subprocess, conftest imported again) makes none. Before, every pytest process left a directory in /tmp."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_the_cache_is_made_once_and_removed_at_exit(tmp_path):
    script = ("import importlib, os, conftest; made = os.environ['ALIGNER_EXT_CACHE']; importlib.reload(conftest); "
              "assert os.environ['ALIGNER_EXT_CACHE'] == made and os.path.isdir(made); print(made)")
    env = {key: value for key, value in os.environ.items() if key != "ALIGNER_EXT_CACHE"}
    run = subprocess.run([sys.executable, "-c", script], cwd=TESTS, capture_output=True, text=True,
                         env={**env, "TMPDIR": str(tmp_path), "PYTHONPATH": str(TESTS)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip()).parent == tmp_path  # it was made where temporary directories go
    assert list(tmp_path.iterdir()) == []  # and nothing is left of it, nor of a second one
