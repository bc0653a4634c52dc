"""A training checkpoint written by this library under megatron-core 0.16 (the release it supported
before 0.19) resumes under the installed one: tests/fixtures/megatron_0_16_checkpoint holds a tiny
Llama's distributed checkpoint saved at TP=2 after 2 RL steps under 0.16.1 (megatron-core 0.16 kept its
non-sharded state in `common.pt`, later releases inside the `.distcp` files), with what the saving run
gathered (tests/megatron/checkpoint_0_16_worker.py `write` says how it was made). One `torchrun
--nproc_per_node=1` launch (gloo, CPU) of that worker's `load` reads it at TP=1:
- the weights, Adam's exp_avg / exp_avg_sq and step equal the saved ones bit for bit;
- a third RL step equals the saving run's third step within 1e-6 absolute on every weight (float32,
  another layout and release: the reduction order differs), a step that moves the weights by more than 1e-3;
- its `common.pt` is read weights-only: a pickle payload planted there never runs and is refused in one
  line naming the file (test_planted_checkpoint.py plants the other files, as the installed release writes them).
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cases import torchrun  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("checkpoint_0_16_worker.py")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_0_16_checkpoint"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("checkpoint_0_16")
    torchrun([str(WORKER), "load", str(work)], processes=1, pythonpath=(str(ROOT),))
    return work


@pytest.fixture(scope="module")
def loaded(work):
    return torch.load(work / "loaded.pt", weights_only=False)


@pytest.fixture(scope="module")
def expected():
    return torch.load(FIXTURE / "expected.pt", weights_only=False)


def test_the_fixture_was_written_by_megatron_core_0_16():
    assert (FIXTURE / "checkpoint" / "megatron" / "common.pt").exists()
    assert sum(file.stat().st_size for file in FIXTURE.rglob("*") if file.is_file()) < 200_000


def test_weights_and_adam_state_load_exactly(loaded, expected):
    for field in ("weight", "exp_avg", "exp_avg_sq"):
        assert loaded["loaded"][field].keys() == expected["saved"][field].keys(), field
        for name, tensor in expected["saved"][field].items():
            assert torch.equal(loaded["loaded"][field][name], tensor), (field, name)
    assert loaded["loaded"]["steps"] == expected["saved"]["steps"] == {4.0}  # 2 RL steps of 2 updates


def test_a_step_after_loading_equals_the_step_of_the_saving_run(loaded, expected):
    for name, tensor in expected["straight"].items():
        assert (loaded["resumed"][name] - tensor).abs().max() <= 1e-6, name
    moved = max((expected["straight"][name] - tensor).abs().max()
                for name, tensor in expected["saved"]["weight"].items())
    assert moved > 1e-3


def test_a_payload_in_its_common_pt_never_runs_and_is_refused_in_one_line(work, loaded):
    refusal = loaded["planted"]
    assert not (work / "common.ran").exists()
    assert {"CheckpointError", "UserError"} <= set(refusal["classes"]), refusal
    assert refusal["message"].startswith(refusal["file"] + ": refusing to load it"), refusal["message"]
    assert "\n" not in refusal["message"] and len(refusal["message"]) < 400
