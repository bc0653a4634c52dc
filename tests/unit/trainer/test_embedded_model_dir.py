"""Building the embedded model: warmed up once, saved, and its GPU memory handed back."""

from __future__ import annotations

import gc
import weakref

import torch

from aligner_ext.config import load_config
from aligner_ext.trainer import build


def test_warmup_model_is_freed_before_the_gpu_cache_is_emptied(tmp_path, monkeypatch):
    cfg = load_config("base", ["model.warmup.steps=1", "model.warmup.batch_size=2", "data.builtin_train_size=8",
                               "model.tiny.hidden_size=16", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
                               "model.tiny.intermediate_size=32"])
    built = []
    real_build = build.build_tiny_model
    monkeypatch.setattr(build, "build_tiny_model", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    refs, alive_at_empty_cache = {}, []

    def empty_cache():
        gc.collect()
        alive_at_empty_cache.append(refs["model"]() is not None)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(build, "resolve_device", lambda device: torch.device("cpu"))
    real_warmup = build.supervised_warmup

    def warmup(model, *args, **kwargs):
        refs["model"] = weakref.ref(built.pop())  # only the builder's own reference remains
        return real_warmup(model, *args, **kwargs)

    monkeypatch.setattr(build, "supervised_warmup", warmup)
    directory = build.embedded_model_dir(cfg, tmp_path)
    assert (directory / "config.json").exists()
    assert alive_at_empty_cache == [False]
    # a second call reuses the saved model: no second warm-up, no second cache release
    assert build.embedded_model_dir(cfg, tmp_path) == directory
    assert alive_at_empty_cache == [False]

