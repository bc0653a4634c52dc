"""Runs under `torchrun --nproc_per_node=1` (gloo, CPU), launched by test_planted_checkpoint.py.

A `MegatronPolicy` (TP=1) of the work directory's tiny HF model trains one step and writes its
distributed checkpoint into `clean/`. Each attack copies it, plants a pickle payload (its
`__reduce__` touches `<work>/<attack>.ran`) in one file the way an attacker would, keeping the rest
loadable, and calls `load_sharded` on the copy. Writes `results.json`: per attack the file, the error's
class names and message (or None when it loaded).
"""

import dataclasses
import functools
import io
import json
import pickle
import shutil
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from transformers import AutoModelForCausalLM

from aligner_ext.models.megatron.parallel import init_distributed
from aligner_ext.models.megatron.policy import MegatronPolicy
from dist_checkpoint_worker import train_step

COMMON_STATE = ShardedObject("common_state", None, (1,), (0,)).unique_key  # megatron-core's non-sharded state


class Payload:
    """Unpickling this touches `marker`: what a planted checkpoint would do with arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def payload_bytes(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    return buffer.getvalue()


def metadata(directory: Path):
    return FileSystemReader(str(directory)).read_metadata()  # our own, unplanted file


def in_metadata(directory: Path, marker: Path) -> Path:
    """A valid `.metadata` with one more attribute: the payload."""
    md = metadata(directory)
    md.planted = Payload(marker)
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    return directory / ".metadata"


def in_item(directory: Path, marker: Path, index) -> Path:
    """The payload appended to the `.distcp` file of item `index` and the metadata's entry of the item
    pointed at it."""
    md = metadata(directory)
    info = md.storage_data[index]
    data = payload_bytes(marker)
    md.storage_data[index] = dataclasses.replace(info, offset=(directory / info.relative_path).stat().st_size,
                                                 length=len(data))
    with open(directory / info.relative_path, "ab") as handle:
        handle.write(data)
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    return directory / info.relative_path


def in_json(directory: Path, marker: Path) -> Path:
    (directory / "metadata.json").write_bytes(payload_bytes(marker))
    return directory / "metadata.json"


def item_kind(md, index) -> str:
    if index.fqn == COMMON_STATE:
        return "common_state"
    return "bytes" if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata) else "tensor"


def attacks(directory: Path) -> dict:
    """Attack name -> planting function, covering every file; each `.distcp` file gets a tensor item and,
    where it holds them, a bytes item (megatron-core's `_extra_state`) and the non-sharded state planted."""
    found = {"metadata": in_metadata, "metadata_json": in_json}
    md = metadata(directory)
    for index, info in md.storage_data.items():
        name = f"{item_kind(md, index)}_item_in_{info.relative_path}"
        found.setdefault(name, functools.partial(in_item, index=index))
    return found


def main() -> None:
    torch.set_num_threads(1)
    init_distributed()
    root = Path(sys.argv[1])
    setup = torch.load(root / "model" / "train_setup.pt", weights_only=False)
    policy = MegatronPolicy(AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32),
                            setup["policy_cfg"], total_steps=4)
    train_step(policy, root / "model")
    (root / "clean").mkdir()
    policy.save_sharded(root / "clean")
    policy.load_sharded(root / "clean")  # the unplanted checkpoint loads
    results = {"clean_files": sorted(p.name for p in (root / "clean" / "megatron").iterdir()), "attacks": {}}
    for name, plant in attacks(root / "clean" / "megatron").items():
        shutil.copytree(root / "clean", root / name)
        file = plant(root / name / "megatron", root / f"{name}.ran")
        try:
            policy.load_sharded(root / name)
            results["attacks"][name] = {"file": str(file), "error": None}
        except Exception as err:  # recorded for the test to judge
            results["attacks"][name] = {"file": str(file), "classes": [c.__name__ for c in type(err).__mro__],
                                        "message": str(err)}
    (root / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
