"""Everything a checkpoint holds follows the umask, the weights included (safetensors alone would
write them 0600)."""

import os

import pytest

from aligner_ext.trainer.checkpoint import Checkpointer


@pytest.fixture
def umask():
    previous = os.umask(0o022)

    def set_mask(mask):
        os.umask(mask)

    yield set_mask
    os.umask(previous)


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                       (0o002, 0o664, 0o775)])
def test_checkpoint_files_follow_the_umask(tmp_path, tiny_model, tiny_tokenizer, umask, mask, file_mode, dir_mode):
    umask(mask)
    path = Checkpointer(tmp_path, keep_last=0).save(1, tiny_model, tiny_tokenizer, {"loader": 1})
    modes = {str(p.relative_to(path)): p.stat().st_mode & 0o777 for p in path.rglob("*")}
    assert modes["model.safetensors"] == file_mode
    assert {mode for name, mode in modes.items() if (path / name).is_file()} == {file_mode}
    assert {mode for name, mode in modes.items() if (path / name).is_dir()} | {path.stat().st_mode & 0o777} == {dir_mode}
