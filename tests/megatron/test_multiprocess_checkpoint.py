"""Checkpoints of multi-process runs (trainer/checkpoint.py): one state file per rank, and a resume
with another number of processes refused with the reason. Single process: torchrun's RANK /
WORLD_SIZE variables are set by hand (no process group exists, so barriers are no-ops)."""

import pytest
import torch

from aligner_ext.trainer.checkpoint import Checkpointer, state_file


def test_state_files_are_named_per_rank():
    assert state_file(0) == "trainer_state.pt" and state_file(3) == "trainer_state.rank3.pt"


def test_resume_with_another_number_of_processes_is_refused(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"policy": {"marker": 7}})
    assert torch.load(path / "trainer_state.pt", weights_only=False)["world_size"] == 2
    assert checkpointer.load(path, tiny_model)["policy"] == {"marker": 7}  # same world: rank 0 resumes

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(FileNotFoundError, match="no trainer_state.rank1.pt"):
        checkpointer.load(path, tiny_model)

    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="written by 2 process\\(es\\); this run has 1"):
        checkpointer.load(path, tiny_model)
