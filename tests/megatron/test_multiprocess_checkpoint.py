"""Checkpoints of multi-process runs (trainer/checkpoint.py): the main process alone writes the trainer
state (the same on every rank), every process writes its sharded policy state into the checkpoint
being written, and a checkpoint resumes with any number of processes. Single process: torchrun's
RANK / WORLD_SIZE variables are set by hand (no process group exists, so barriers are no-ops)."""

import json

import torch

from aligner_ext.trainer.checkpoint import Checkpointer


def write_shard(calls: list):
    """A `save_sharded` hook that records where it was called and writes one file there."""
    def save_sharded(directory, background):
        calls.append(directory)
        (directory / "shards").mkdir()
        (directory / "shards" / "part").write_text("shard")
    return save_sharded


def test_rank_0_writes_the_state_and_the_hook_writes_inside_the_checkpoint(tmp_path, monkeypatch, tiny_model,
                                                                            tiny_tokenizer):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = []
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"policy": {"marker": 7}}, write_shard(calls))
    assert calls == [checkpointer.directory / ".step_1.tmp"]  # called before the rename into place
    assert (path / "shards" / "part").read_text() == "shard"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors", "shards", "tokenizer",
                                                      "trainer_state.pt"]
    assert "shards/part" in json.loads((path / "manifest.json").read_text())["files"]  # the shards are verified too


def test_another_rank_writes_only_through_the_hook(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    tmp = checkpointer.directory / ".step_1.tmp"
    tmp.mkdir(parents=True)  # what rank 0 does before the first barrier
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = []
    checkpointer.save(1, tiny_model, tiny_tokenizer, {"policy": {"marker": 7}}, write_shard(calls))
    assert calls == [tmp]
    assert [p.name for p in tmp.iterdir()] == ["shards"]  # no trainer state, weights or tokenizer
    assert not (checkpointer.directory / "step_1").exists()  # rank 0 publishes


def test_a_checkpoint_of_2_processes_resumes_on_any_rank_and_with_1_process(tmp_path, monkeypatch, tiny_model,
                                                                           tiny_tokenizer):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"policy": {"marker": 7}})
    monkeypatch.setenv("RANK", "1")
    assert checkpointer.load(path, tiny_model)["policy"] == {"marker": 7}  # rank 1 reads rank 0's state
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    state = checkpointer.load(path, tiny_model)
    assert state["policy"] == {"marker": 7} and state["step"] == 1
    assert isinstance(state["rng"]["torch"], torch.Tensor)
