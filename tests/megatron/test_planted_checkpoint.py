"""A Megatron checkpoint handed over by someone else cannot run code on resume
(models/megatron/dist_checkpoint.py): one `torchrun --nproc_per_node=1` launch (gloo, CPU) of
tests/megatron/planted_checkpoint_worker.py plants a pickle payload in each file of a distributed
checkpoint in turn (`.metadata`, a tensor item, a bytes item and megatron-core's non-sharded state
`common_state` of each `.distcp` file, `metadata.json`) and loads it. The trainer's manifest would be recomputed by such an attacker, so it
does not enter here; `trainer_state.pt` is tests/unit/trainer/test_checkpoint.py's."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

pytest.importorskip("megatron.core")

from megatron_cases import build_model, hf_configs, torchrun  # noqa: E402
from test_megatron_tp_pp import train_setup  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("planted_checkpoint_worker.py")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    config = hf_configs()["llama"]
    build_model(config).save_pretrained(root / "model")
    torch.save(train_setup(config.vocab_size), root / "model" / "train_setup.pt")
    torchrun([str(WORKER), str(root)], processes=1)
    return root


def results(root: Path) -> dict:
    return json.loads((root / "results.json").read_text())


def test_every_file_of_the_checkpoint_was_planted(root):
    found = results(root)
    assert set(found["clean_files"]) == {Path(attack["file"]).name for attack in found["attacks"].values()}
    assert any(name.startswith("bytes_item") for name in found["attacks"])  # megatron-core's _extra_state
    assert any(name.startswith("common_state_item") for name in found["attacks"])


def test_a_planted_payload_never_runs_and_the_refusal_is_one_line_naming_the_file(root):
    for name, result in results(root)["attacks"].items():
        assert not (root / f"{name}.ran").exists(), name
        assert {"CheckpointError", "UserError"} <= set(result.get("classes", [])), (name, result)
        assert "\n" not in result["message"] and len(result["message"]) < 400, (name, result["message"])
        # an item of a .distcp file fails inside torch.distributed.checkpoint's reader: the directory is named
        named = str(Path(result["file"]).parent) if "_item_" in name else result["file"]
        assert result["message"].startswith(named + ":"), (name, result["message"])


def test_the_planted_metadata_runs_its_payload_under_torchs_own_reader(root):
    """The payload is live: torch.distributed.checkpoint's FileSystemReader unpickles it."""
    marker = root / "metadata.ran"
    FileSystemReader(str(root / "metadata" / "megatron")).read_metadata()
    assert marker.exists()
    marker.unlink()
