"""The test environments' builders (scripts/setup_megatron_env.sh, scripts/setup_vllm_cpu.sh) on a disk that cannot
hold them: one line naming the space needed and free, exit status 28 (ENOSPC), nothing created, pip never started."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("script", "needed_gb"), [("setup_megatron_env.sh", 8), ("setup_vllm_cpu.sh", 4)])
def test_a_disk_too_small_for_the_environment_is_one_line_before_anything_is_built(tmp_path, script, needed_gb):
    tools = tmp_path / "bin"  # a df reporting 3 GB free (in 1K blocks, as `df -Pk` prints), ahead of the real one
    tools.mkdir()
    (tools / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                              f"echo 'fake 9999999 0 {3 * 1024 * 1024} 1% /'\n")
    (tools / "df").chmod(0o755)
    (tools / "python3").write_text("#!/bin/sh\nexit 1\n")  # without the check the build would start here, and fail
    (tools / "python3").chmod(0o755)
    venv = tmp_path / "venv"
    run = subprocess.run(["/bin/bash", str(REPO / "scripts" / script), str(venv)], capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}",
                              "ALIGNER_EXT_PYTHON312": "/nonexistent/python3.12"})  # never run: the check comes first
    assert run.returncode == 28
    assert run.stderr.count("\n") == 1
    assert f"needs about {needed_gb} GB free on the filesystem of {tmp_path}; 3 GB are free" in run.stderr
    assert not venv.exists()
