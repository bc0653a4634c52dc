"""Checkpointer: exact round trip (weights, optimizer, RNG), atomic saves, pruning, the `latest` pointer."""

import copy
import hashlib
import json
import logging
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aligner_ext.errors import UserError
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model
from aligner_ext.trainer import checkpoint as checkpoint_module
from aligner_ext.trainer.checkpoint import Checkpointer
from aligner_ext.trainer.loop import resume

# the conftest model's size, so a checkpoint of `tiny_model` fits
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


def trained_one_step(model):
    """An AdamW optimizer after one update of `model`, so its state holds step, exp_avg and exp_avg_sq."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def blank_model(tokenizer):
    """A model of the same shape with every weight 0.123 (no trained weight equals it exactly)."""
    model = build_tiny_model(tokenizer, TinyModelConfig(**TINY, seed=1)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(0.123)
    return model


def draws():
    """The next value of each RNG the checkpoint restores."""
    return torch.rand(3), random.random(), np.random.rand(3)


def assert_draws_equal(actual, expected):
    assert torch.equal(actual[0], expected[0])
    assert actual[1] == expected[1]
    np.testing.assert_array_equal(actual[2], expected[2])


def assert_nested_equal(actual, expected, where="state"):
    assert type(actual) is type(expected), where
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_nested_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_equal(a, e, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def weights(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path, tiny_model, tiny_tokenizer):
    optimizer = trained_one_step(tiny_model)
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"optimizer": optimizer.state_dict(), "loader": 17})
    expected_draws = draws()  # what the RNGs give right after saving
    saved_weights = weights(tiny_model)

    # perturb everything the checkpoint should restore
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    with torch.no_grad():
        for parameter in tiny_model.parameters():
            parameter.add_(1.0)
    fresh = blank_model(tiny_tokenizer)
    state = checkpointer.load(path, fresh)

    assert_draws_equal(draws(), expected_draws)
    loaded = weights(fresh)
    assert loaded.keys() == saved_weights.keys()
    for name, tensor in saved_weights.items():
        assert torch.equal(loaded[name], tensor), name
    assert state["step"] == 1 and state["loader"] == 17
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_optimizer.load_state_dict(state["optimizer"])
    assert_nested_equal(fresh_optimizer.state_dict(), saved_optimizer)
    assert len(saved_optimizer["state"]) > 0  # the comparison covered exp_avg / exp_avg_sq, not an empty state


def test_tied_embeddings_stay_tied_after_load(tmp_path, tiny_model, tiny_tokenizer):
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight  # the tiny model ties them
    trained_one_step(tiny_model)
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {})
    fresh = blank_model(tiny_tokenizer)
    checkpointer.load(path, fresh)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, tiny_model.model.embed_tokens.weight)


@pytest.mark.parametrize("change, reason", [
    ({"num_layers": 1}, "unexpected"),  # the checkpoint has a layer the model lacks
    ({"hidden_size": 64}, "size mismatch"),  # same names, other shapes
])
def test_load_into_a_model_of_another_shape_names_the_checkpoint(tmp_path, tiny_model, tiny_tokenizer, change,
                                                                   reason):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {})
    other = build_tiny_model(tiny_tokenizer, TinyModelConfig(**{**TINY, **change}))
    with pytest.raises(RuntimeError, match=f"(?s)checkpoint .*step_1 does not fit the model: .*{reason}"):
        checkpointer.load(path, other)


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    first = checkpointer.save(1, tiny_model, tiny_tokenizer, {"marker": "first"})
    first_weights = weights(tiny_model)
    with torch.no_grad():
        tiny_model.model.embed_tokens.weight.add_(1.0)

    real_save = torch.save

    def crash(obj, target, *args, **kwargs):  # the weights and tokenizer are already written by now
        with open(target, "wb") as handle:
            handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpointer.save(2, tiny_model, tiny_tokenizer, {"marker": "second"})
    monkeypatch.setattr(torch, "save", real_save)

    assert checkpointer.latest() == first
    assert not (checkpointer.directory / "step_2").exists()
    assert sorted(p.name for p in checkpointer.directory.glob("step_*")) == ["step_1"]
    fresh = blank_model(tiny_tokenizer)
    state = checkpointer.load(checkpointer.latest(), fresh)
    assert state["marker"] == "first"
    for name, tensor in weights(fresh).items():
        assert torch.equal(tensor, first_weights[name]), name

    # the resumed run saves the same step again over the partial directory
    second = checkpointer.save(2, tiny_model, tiny_tokenizer, {"marker": "second"})
    assert checkpointer.latest() == second
    assert checkpointer.load(second, fresh)["marker"] == "second"


@pytest.mark.parametrize("keep_last, steps, kept", [
    (2, [1, 2, 3, 4], ["step_3", "step_4"]),
    (2, [8, 9, 10], ["step_10", "step_9"]),  # by step number, not by name ("step_10" < "step_8")
    (1, [1, 2], ["step_2"]),
    (0, [1, 2, 3], ["step_1", "step_2", "step_3"]),  # 0 keeps all
])
def test_keep_last_prunes_all_but_the_newest(tmp_path, tiny_model, tiny_tokenizer, keep_last, steps, kept):
    checkpointer = Checkpointer(tmp_path, keep_last=keep_last)
    for step in steps:
        checkpointer.save(step, tiny_model, tiny_tokenizer, {})
    assert sorted(p.name for p in checkpointer.directory.glob("step_*")) == kept
    assert checkpointer.latest() == checkpointer.directory / f"step_{steps[-1]}"


def test_latest_is_none_before_any_save(tmp_path):
    assert Checkpointer(tmp_path, keep_last=2).latest() is None


def test_a_stale_latest_pointer_is_only_a_hint(tmp_path, tiny_model, tiny_tokenizer, caplog):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    checkpointer.save(1, tiny_model, tiny_tokenizer, {})
    (checkpointer.directory / checkpoint_module.LATEST).write_text("step_7\n")  # names nothing that exists
    with caplog.at_level(logging.WARNING, logger="aligner_ext.trainer.checkpoint"):
        assert checkpointer.latest() == checkpointer.directory / "step_1"
    assert "names step_7; the newest complete checkpoint is step_1" in caplog.text


def test_a_kill_between_the_rename_and_the_pointer_keeps_the_new_checkpoint(tmp_path, tiny_model, tiny_tokenizer,
                                                                            monkeypatch):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    checkpointer.save(1, tiny_model, tiny_tokenizer, {"marker": "first"})
    real_write = checkpoint_module._write_text_atomically

    def killed_at_the_pointer(path, text):
        if path.name == checkpoint_module.LATEST:
            raise KeyboardInterrupt  # step_2 is renamed into place, `latest` still names step_1
        return real_write(path, text)

    monkeypatch.setattr(checkpoint_module, "_write_text_atomically", killed_at_the_pointer)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(2, tiny_model, tiny_tokenizer, {"marker": "second"})
    assert (checkpointer.directory / checkpoint_module.LATEST).read_text().strip() == "step_1"
    assert checkpointer.latest() == checkpointer.directory / "step_2"
    assert checkpointer.load(checkpointer.latest(), blank_model(tiny_tokenizer))["marker"] == "second"


def flip_a_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: flip_a_byte(p / "model.safetensors", -3), r"model.safetensors: its SHA-256 differs"),
    (lambda p: (p / checkpoint_module.STATE_FILE).write_bytes((p / checkpoint_module.STATE_FILE).read_bytes()[:100]),
     r"trainer_state.pt: 100 bytes, the manifest says \d+ \(truncated"),
    (lambda p: (p / "tokenizer" / "tokenizer_config.json").unlink(), r"tokenizer_config.json: missing"),
    (lambda p: (p / checkpoint_module.MANIFEST).write_text("{not json"), r"manifest.json: unreadable"),
])
def test_a_damaged_file_is_named_by_verify(tmp_path, tiny_model, tiny_tokenizer, damage, message):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"loader": 1})
    checkpointer.verify(path)  # intact: no error
    damage(path)
    with pytest.raises(checkpoint_module.CorruptCheckpoint, match=message):
        checkpointer.verify(path)


def test_the_manifest_lists_every_file_with_its_size_and_hash(tmp_path, tiny_model, tiny_tokenizer):
    path = Checkpointer(tmp_path, keep_last=0).save(1, tiny_model, tiny_tokenizer, {})
    manifest = json.loads((path / checkpoint_module.MANIFEST).read_text())
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {checkpoint_module.MANIFEST}
    assert set(manifest["files"]) == on_disk and manifest["step"] == 1
    weights_entry = manifest["files"]["model.safetensors"]
    data = (path / "model.safetensors").read_bytes()
    assert weights_entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_crash_while_resaving_a_step_recovers_its_previous_copy(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    first = checkpointer.save(3, tiny_model, tiny_tokenizer, {"marker": "first"})
    real_replace = checkpoint_module.os.replace
    calls = []

    def crash_moving_the_new_copy_in(src, dst):
        calls.append((src, dst))
        if Path(src).name == ".step_3.tmp":  # the old copy is aside, the new one not yet in place
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "replace", crash_moving_the_new_copy_in)
    with pytest.raises(OSError, match="killed"):
        checkpointer.save(3, tiny_model, tiny_tokenizer, {"marker": "second"})
    monkeypatch.setattr(checkpoint_module.os, "replace", real_replace)
    assert (Path(calls[-2][0]), Path(calls[-2][1]).name) == (first, ".step_3.old")  # moved aside just before
    assert not first.exists()
    assert checkpointer.latest() == first
    assert checkpointer.load(first, tiny_model)["marker"] == "first"


class Payload:
    """Unpickling this touches `marker`: what a planted checkpoint would do with arbitrary code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_payload_never_runs(tmp_path, tiny_model, tiny_tokenizer):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"loader": 3})
    marker = tmp_path / "payload_ran"
    state = torch.load(path / checkpoint_module.STATE_FILE, weights_only=True)
    torch.save({**state, "loader": Payload(marker)}, path / checkpoint_module.STATE_FILE)
    with pytest.raises(RuntimeError, match="refusing to load"):
        checkpointer.load(path, blank_model(tiny_tokenizer))
    assert not marker.exists()
    torch.load(path / checkpoint_module.STATE_FILE, weights_only=False)  # the payload is live: unsafe loading runs it
    assert marker.exists()


def test_a_dynamic_sampling_surplus_batch_survives_the_safe_loader(tmp_path, tiny_model, tiny_tokenizer, make_batch):
    surplus = make_batch([[1, 1, 0]], rewards=[0.5])
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    path = checkpointer.save(1, tiny_model, tiny_tokenizer, {"maker": {"surplus": surplus}})
    loaded = checkpointer.load(path, blank_model(tiny_tokenizer))["maker"]["surplus"]
    assert torch.equal(loaded.response_mask, surplus.response_mask) and loaded.samples == surplus.samples


def rewrite_manifest(path):
    """What an attacker who edits a checkpoint does: recompute the manifest so that it verifies."""
    (path / checkpoint_module.MANIFEST).unlink()
    checkpoint_module._write_manifest(path, int(path.name.split("_")[1]))


def test_a_payload_planted_in_any_file_of_an_hf_checkpoint_never_runs(tmp_path, tiny_model, tiny_tokenizer):
    """Each file in turn replaced by a pickle payload, the manifest recomputed: loading either refuses in
    one line naming the file or never reads it (the tokenizer's files are not loaded on resume)."""
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    clean = checkpointer.save(1, tiny_model, tiny_tokenizer, {"loader": 3})
    files = sorted(str(p.relative_to(clean)) for p in clean.rglob("*") if p.is_file() and p.name != "manifest.json")
    refused = set()
    for number, name in enumerate(files, start=2):
        path = checkpointer.directory / f"step_{number}"
        shutil.copytree(clean, path)
        marker = tmp_path / f"ran_{number}"
        torch.save(Payload(marker), path / name)
        rewrite_manifest(path)
        checkpointer.verify(path)
        try:
            checkpointer.load(path, blank_model(tiny_tokenizer))
        except UserError as err:
            assert str(err).startswith(f"{path / name}:") and "\n" not in str(err), str(err)
            refused.add(name)
        assert not marker.exists(), name
    assert refused == {"model.safetensors", checkpoint_module.STATE_FILE}


def test_a_checkpoint_without_a_manifest_is_refused_unless_allowed(tmp_path, tiny_model, tiny_tokenizer, caplog):
    path = Checkpointer(tmp_path, keep_last=0).save(1, tiny_model, tiny_tokenizer, {})
    flip_a_byte(path / "model.safetensors", -3)
    (path / checkpoint_module.MANIFEST).unlink()  # what would switch the check off
    with pytest.raises(checkpoint_module.UnverifiedCheckpoint) as refused:
        Checkpointer(tmp_path, keep_last=0).verify(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: no manifest.json") and "trainer.allow_unverified_checkpoint=true" in message
    assert "\n" not in message and not isinstance(refused.value, checkpoint_module.CorruptCheckpoint)
    allowed = Checkpointer(tmp_path, keep_last=0, allow_unverified=True)
    with caplog.at_level(logging.WARNING, logger="aligner_ext.trainer.checkpoint"):
        allowed.verify(path)  # the user vouches for it
    assert "loading it unverified" in caplog.text
    allowed.load(path, blank_model(tiny_tokenizer))


def test_resume_stops_at_a_checkpoint_without_a_manifest_instead_of_falling_back(tmp_path, tiny_model,
                                                                                 tiny_tokenizer):
    """Falling back would resume an older step silently; the user is asked instead."""
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    checkpointer.save(1, tiny_model, tiny_tokenizer, {})
    newest = checkpointer.save(2, tiny_model, tiny_tokenizer, {})
    (newest / checkpoint_module.MANIFEST).unlink()
    cfg = SimpleNamespace(trainer=SimpleNamespace(resume=True))
    parts = SimpleNamespace(policy=SimpleNamespace(restores_own_weights=False, model=blank_model(tiny_tokenizer)))
    with pytest.raises(checkpoint_module.UnverifiedCheckpoint, match=f"^{newest}: no manifest.json"):
        resume(cfg, parts, checkpointer)


def test_a_kill_while_pruning_leaves_no_checkpoint_without_its_manifest(tmp_path, tiny_model, tiny_tokenizer,
                                                                        monkeypatch):
    checkpointer = Checkpointer(tmp_path, keep_last=1)
    checkpointer.save(1, tiny_model, tiny_tokenizer, {})
    real_rmtree = shutil.rmtree

    def killed_after_the_manifest(path, ignore_errors=False):
        if Path(path).name.startswith(".step_1"):
            (Path(path) / checkpoint_module.MANIFEST).unlink()  # deleted first, then the kill
            raise KeyboardInterrupt
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_after_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(2, tiny_model, tiny_tokenizer, {})
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", real_rmtree)
    assert checkpointer.complete() == [checkpointer.directory / "step_2"]
    checkpointer.save(3, tiny_model, tiny_tokenizer, {})  # the next save clears what the kill left
    assert sorted(p.name for p in checkpointer.directory.iterdir()) == ["latest", "step_3"]
