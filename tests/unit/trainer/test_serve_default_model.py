"""`aligner-ext serve` without model.path serves a trained policy: the named run's, else the newest
run's under trainer.output_dir; the embedded model only when there is none."""

import os

from aligner_ext.cli import serve_trained_model
from aligner_ext.config import load_config


def exported(output, name, mtime):
    model = output / name / "hf_model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    os.utime(model / "config.json", (mtime, mtime))
    return model


def test_the_newest_trained_policy_is_served_unless_a_run_is_named(tmp_path):
    older, newer = exported(tmp_path, "demo", 1_000), exported(tmp_path, "demo_mtpo", 2_000)
    (tmp_path / "unfinished").mkdir()  # a run without hf_model is not a candidate
    cfg = load_config("base", [f"trainer.output_dir={tmp_path}"], for_training=False)
    serve_trained_model(cfg, named_run=False)
    assert cfg.model.path == str(newer)
    cfg = load_config("base", [f"trainer.output_dir={tmp_path}", "trainer.run_name=demo"], for_training=False)
    serve_trained_model(cfg, named_run=True)
    assert cfg.model.path == str(older)


def test_with_no_trained_policy_the_embedded_model_is_served_with_a_warning(tmp_path, caplog):
    cfg = load_config("base", [f"trainer.output_dir={tmp_path}", "trainer.run_name=absent"], for_training=False)
    serve_trained_model(cfg, named_run=True)
    assert cfg.model.path is None
    assert "no trained policy" in caplog.text and "serving the embedded model before RL" in caplog.text
