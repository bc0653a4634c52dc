"""The warmed embedded model is kept per machine, keyed by the warm-up's inputs: a second run of the
same warm-up copies it (no training), a changed input trains anew, `none` keeps nothing."""

import pytest
from safetensors.torch import load_file

import aligner_ext.trainer.build as build
from aligner_ext.config import load_config
from aligner_ext.models.warmup_cache import cache_root

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
         "model.tiny.intermediate_size=64", "model.warmup.steps=3", "model.warmup.batch_size=4",
         "data.builtin_train_size=16", "trainer.progress_bar=false"]


@pytest.fixture
def warmups(monkeypatch):
    """Counts the warm-ups that actually train."""
    calls = []
    real = build.supervised_warmup

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "supervised_warmup", counting)
    return calls


def weights(directory):
    return load_file(directory / "model.safetensors")


def test_the_same_warmup_is_trained_once_per_cache(tmp_path, warmups):
    cache = tmp_path / "cache"
    cfg = load_config("base", [*SMALL, f"model.warmup.cache_dir={cache}"])
    first = build.embedded_model_dir(cfg, tmp_path / "run_a")
    second = build.embedded_model_dir(cfg, tmp_path / "run_b")
    assert len(warmups) == 1 and len(list(cache.iterdir())) == 1
    assert all((weights(first)[name] == tensor).all() for name, tensor in weights(second).items())
    build.embedded_model_dir(load_config("base", [*SMALL, f"model.warmup.cache_dir={cache}", "model.warmup.lr=2e-3"]),
                             tmp_path / "run_c")
    assert len(warmups) == 2 and len(list(cache.iterdir())) == 2  # another input: another entry


def test_cache_none_keeps_nothing(tmp_path, warmups):
    cfg = load_config("base", [*SMALL, "model.warmup.cache_dir=none"])
    build.embedded_model_dir(cfg, tmp_path / "run_a")
    build.embedded_model_dir(cfg, tmp_path / "run_b")
    assert len(warmups) == 2 and cache_root("none") is None


def test_auto_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNER_EXT_CACHE", str(tmp_path / "mine"))
    assert cache_root("auto") == tmp_path / "mine" / "warmup"
    monkeypatch.delenv("ALIGNER_EXT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("auto") == tmp_path / "xdg" / "aligner_ext" / "warmup"
