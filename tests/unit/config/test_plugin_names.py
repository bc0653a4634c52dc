"""Checking a configuration reads plug-in names and settings from torch-free modules: the generated table
(aligner_ext/plugin_names.py) must match the registries, the name lists of the settings modules must
match the code that implements them, and a wrong name is refused without importing a plug-in
(tests/unit/test_cli_imports.py checks the commands themselves)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_plugin_table_matches_the_registries():
    spec = importlib.util.spec_from_file_location("gen_plugin_names", ROOT / "scripts" / "gen_plugin_names.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.TABLE.read_text() == generator.render(), f"stale: run `{generator.REGENERATE}`"


def test_setting_name_lists_match_their_implementations():
    from aligner_ext.experience.filters import FILTERS
    from aligner_ext.experience.settings import FILTER_METRICS
    from aligner_ext.generation.decoder import DECODE_ATTENTION
    from aligner_ext.generation.settings import ATTENTION_CHOICES
    from aligner_ext.losses.aggregation import AGG_MODES
    from aligner_ext.losses.settings import AGG_MODE_NAMES

    assert ATTENTION_CHOICES == ("auto", *DECODE_ATTENTION)
    assert FILTER_METRICS == tuple(FILTERS)
    assert AGG_MODE_NAMES == tuple(AGG_MODES)


def test_a_wrong_plugin_name_is_refused_without_importing_plugins():
    probe = ("import sys\n"
             "from aligner_ext.config import load_config\n"
             "try:\n"
             "    load_config('base', ['algorithm.loss=clipped_pgg'])\n"
             "except ValueError as err:\n"
             "    print('ERROR', err)\n"
             "print('TORCH', 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "did you mean 'clipped_pg'?" in result.stdout, result.stdout + result.stderr
    assert "TORCH False" in result.stdout
