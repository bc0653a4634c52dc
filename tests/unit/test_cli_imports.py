"""`aligner-ext --help`, each subcommand's help and `aligner-ext config` answer without importing torch,
transformers or megatron: the CLI parses its arguments first, and settings are checked from torch-free
modules (`<package>/settings.py`, aligner_ext/plugin_names.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "megatron")


def loaded_after(argv: list[str]) -> tuple[int, list[str], str]:
    """(exit status, heavy modules loaded, output) of `aligner-ext <argv>` in a fresh interpreter."""
    probe = ("import sys\n"
             "from aligner_ext.cli import main\n"
             "try:\n"
             f"    status = main({argv!r})\n"
             "except SystemExit as stop:\n"
             "    status = stop.code\n"
             f"print('LOADED', status, sorted(name for name in {HEAVY!r} if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    line = next(line for line in result.stdout.splitlines() if line.startswith("LOADED"))
    _, status, loaded = line.split(" ", 2)
    return int(status), eval(loaded), result.stdout + result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["serve", "--help"], ["demo", "--help"]])
def test_help_imports_no_model_library(argv):
    status, loaded, output = loaded_after(argv)
    assert status == 0 and loaded == [], output[-800:]
    assert "usage: aligner-ext" in output


def test_config_imports_no_model_library():
    status, loaded, output = loaded_after(["config", "+variant=dapo", "rollout.n=4"])
    assert status == 0 and loaded == [], output[-800:]
    assert "'n': 4" in output and "epsilon_high: 0.28" in output  # the composed config: the override and DAPO's overlay


def test_a_config_error_imports_no_model_library():
    status, loaded, output = loaded_after(["config", "rollout.n=1"])
    assert status == 2 and loaded == [], output[-800:]
    assert "rollout.n=1" in output
