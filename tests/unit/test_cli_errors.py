"""A user error under torchrun (aligner_ext/cli.py::fail): every rank exits 2, rank 0 alone prints the
line; another rank waits for torchrun to stop it (SIGTERM) and then exits 2 silently, and prints its
own line only if nobody stops it (an error rank 0 did not meet)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ERROR = "aligner-ext: config error:"


def start(rank: int, tmp_path, wait_s: float | None = None) -> subprocess.Popen:
    """`aligner-ext train` with an unknown key, as rank `rank` of 2; it touches <tmp_path>/waiting
    when it starts to wait."""
    marker = tmp_path / "waiting"
    snippet = (
        "import time, aligner_ext.cli as cli; sleep = time.sleep; "
        f"time.sleep = lambda s: (open({str(marker)!r}, 'w').close(), sleep(s)); "
        + (f"cli.OWN_ERROR_WAIT_S = {wait_s}; " if wait_s is not None else "")
        + "cli.main(['train', 'trainer.no_such_key=1'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK=str(rank), WORLD_SIZE="2")
    return subprocess.Popen([sys.executable, "-c", snippet], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_rank_0_prints_the_line_and_exits_2(tmp_path):
    process = start(0, tmp_path)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert stderr.count(ERROR) == 1 and "trainer.no_such_key" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "waiting").exists()


def test_another_rank_stopped_by_torchrun_exits_2_silently(tmp_path):
    process = start(1, tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "waiting").exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # what torchrun does once rank 0 has exited
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    assert ERROR not in stderr and "Traceback" not in stderr


def test_another_rank_nobody_stops_prints_its_own_line(tmp_path):
    process = start(1, tmp_path, wait_s=0.2)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2 and stderr.count(ERROR) == 1 and (tmp_path / "waiting").exists()


def test_ctrl_c_during_training_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    import pytest

    import aligner_ext.trainer.loop
    from aligner_ext.cli import main

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(aligner_ext.trainer.loop, "train", interrupted)
    with pytest.raises(SystemExit) as stopped:
        main(["train", f"trainer.output_dir={tmp_path}"])
    assert stopped.value.code == 130
    err = capsys.readouterr().err
    assert err == "aligner-ext: interrupted; the same command resumes from the newest checkpoint\n"


def test_a_generation_server_that_stops_answering_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    import pytest
    import torch

    import aligner_ext.trainer.loop
    from aligner_ext.cli import main
    from aligner_ext.distributed import free_port
    from aligner_ext.generation.base import SamplingParams
    from aligner_ext.generation.remote import RemoteEngine, RemoteEngineConfig

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a server that died

    def through_a_dead_server(cfg):
        engine = RemoteEngine(torch.nn.Linear(1, 1), None, RemoteEngineConfig(urls=[url], server_kind="vllm",
                                                                               max_retries=0))
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=1))

    monkeypatch.setattr(aligner_ext.trainer.loop, "train", through_a_dead_server)
    with pytest.raises(SystemExit) as stopped:
        main(["train", f"trainer.output_dir={tmp_path}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("aligner-ext:")]  # beside the engine's warnings
    assert len(errors) == 1
    assert errors[0].startswith(f"aligner-ext: error: generation server {url} failed (retried up to 0 times")
    assert "APIConnectionError" in errors[0] and "--max-num-batched-tokens and --max-num-seqs" in errors[0]
