"""The embedded job trains through a local `aligner-ext serve` server (generator.engine=remote), the
weights pushed in memory after every step, with the truncated importance-sampling correction on."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from aligner_ext.config import load_config
from aligner_ext.serving.server import build_server
from aligner_ext.trainer.loop import train
from served_engine import serve_in_thread
from small_run import SMALL_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_demo_loop_trains_through_a_local_server(tmp_path):
    common = SMALL_MODEL + ["rollout.max_response_length=16", "trainer.total_steps=2", "trainer.tensorboard=false",
                            f"trainer.output_dir={tmp_path}", "trainer.run_name=remote"]
    server = build_server(load_config("base", common + ["generator.engine=rollout"]))  # builds the embedded model
    with serve_in_thread(server) as url:
        train(load_config("base", common + [
            "generator.engine=remote", f"generator.remote.urls=[{url}]",
            "generator.remote.weight_sync=distributed", "generator.remote.weight_sync_address=127.0.0.1",
            "loss.importance_sampling_cap=2"]))
    records = [json.loads(line) for line in (tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 1, 2]
    for record in records[1:]:
        assert record["batch/num_samples"] > 0 and "actor/grad_norm" in record
        assert record["rollout/logprob_diff_max"] < 1e-4  # the server samples from the trainer's current weights
        assert record["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # so the TIS weights are ~1
    assert server.weight_version == 2  # one push after each step
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "remote" / "hf_model")
    served = dict(server.model.named_parameters())
    assert all(torch.equal(served[name], param) for name, param in final.named_parameters())
