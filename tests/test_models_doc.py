"""docs/models.md is what scripts/gen_models_doc.py renders from the code's own tables (`FAMILIES`,
the Liger patches, the verdicts of aligner_ext/support.py): a family added or renamed, or a backend
or engine that starts or stops running one, without regenerating the page fails here."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from aligner_ext.architecture import FAMILIES

pytest.importorskip("megatron.core")  # the Megatron columns ask the backend itself

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_models_doc.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_models_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_tables_render(generator):
    assert generator.DOC.read_text(encoding="utf-8") == generator.render(), (
        f"docs/models.md is out of date; regenerate it with `{generator.REGENERATE}`")


def test_a_family_renamed_without_regenerating_is_caught(generator, monkeypatch):
    monkeypatch.setitem(FAMILIES, "olmo2", dataclasses.replace(FAMILIES["olmo2"], name="OLMo 2 (renamed)"))
    rendered = generator.render()
    assert "| OLMo 2 (renamed) (`olmo2`) | yes |" in rendered
    assert generator.DOC.read_text(encoding="utf-8") != rendered
