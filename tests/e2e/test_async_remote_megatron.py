"""Generation ahead of training on a generation server with the Megatron backend under torchrun (two processes
at DP=2, gloo, CPU): the disaggregated placement with several training ranks. Each rank's generation thread
splits its calls across the ranks over a gloo group of its own (trainer/build.py::generation_ahead_engines), so
its gathers never meet training's collectives. At max_staleness=0 the run is the synchronous run through the
same server bit for bit (metrics, and the exported weights); at 1 every later batch is sampled one version
behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from test_async_remote import AHEAD, SMALL, serving_the_embedded_model  # noqa: E402
from test_async_runs import learning_metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).parent


@pytest.fixture
def served(tmp_path):
    """(the server, its URL); it takes pushed weights from under tmp_path, where the runs write."""
    with serving_the_embedded_model(tmp_path, "rollout") as (server, url):
        yield server, url


def run_under_torchrun(tmp_path, url, name, *extra) -> tuple[list[dict], Path]:
    """`aligner-ext train` on the Megatron backend at DP=2 through the server at `url`; its metrics records."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               "-m", "aligner_ext", "train", *SMALL, "trainer.total_steps=2", "policy.backend=megatron",
               "trainer.export_hf=true",
               f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "generator.engine=remote",
               f"generator.remote.urls=[{url}]", "generator.remote.weight_sync=disk",
               f"generator.remote.weight_sync_dir={tmp_path / name / 'push'}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    run_dir = tmp_path / name
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], run_dir


def test_staleness_zero_under_torchrun_is_the_synchronous_run_and_one_trains_a_version_behind(tmp_path, served):
    server, url = served
    synchronous, sync_dir = run_under_torchrun(tmp_path, url, "sync")  # first: the server has the loaded weights
    ahead, ahead_dir = run_under_torchrun(tmp_path, url, "ahead", *AHEAD, "trainer.asynchronous.max_staleness=0")
    assert [learning_metrics(r) for r in ahead] == [learning_metrics(r) for r in synchronous]
    assert all(r["actor/grad_norm"] > 0 for r in synchronous[1:])
    expected, got = (load_file(str(run / "hf_model" / "model.safetensors")) for run in (sync_dir, ahead_dir))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)

    behind, _ = run_under_torchrun(tmp_path, url, "behind", *AHEAD, "trainer.asynchronous.max_staleness=1")
    steps = [record for record in behind if "staleness/max" in record]
    assert [record["staleness/max"] for record in steps] == [0, 1]  # step 1's batch: the loaded weights
    assert steps[1]["staleness/share_lag_1"] == 1
