"""scripts/setup_megatron_env.sh (the Python 3.12 environment the megatron-core tests run in, tests/megatron_env.py)
on a machine without Python 3.12: one line saying what to install, exit status 3, nothing created."""

import os
import shutil
import subprocess
from pathlib import Path

from megatron_env import NO_PYTHON_312

REPO = Path(__file__).resolve().parents[2]


def test_no_python_3_12_is_one_line_saying_what_to_install(tmp_path):
    tools = tmp_path / "bin"  # a PATH with no python3.12 and no pyenv: only what the script runs before looking
    tools.mkdir()
    os.symlink(shutil.which("dirname"), tools / "dirname")
    env = {key: value for key, value in os.environ.items() if key != "ALIGNER_EXT_PYTHON312"}
    run = subprocess.run(["/bin/bash", str(REPO / "scripts" / "setup_megatron_env.sh"), str(tmp_path / "venv")],
                         env={**env, "PATH": str(tools)}, capture_output=True, text=True)
    assert run.returncode == NO_PYTHON_312
    assert run.stderr == ("scripts/setup_megatron_env.sh: no Python 3.12 found (megatron-core 0.19 needs Python >= "
                          "3.12): install one (pyenv install 3.12) or set ALIGNER_EXT_PYTHON312 to its interpreter\n")
    assert not (tmp_path / "venv").exists()
