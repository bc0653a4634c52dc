"""The Megatron backend runs on one megatron-core release, the one setup.py's `megatron` extra admits: another,
or none, is refused at config load in one line naming what is installed and what to install
(`support.check_megatron_core`)."""

import re
from pathlib import Path

import pytest

from aligner_ext.errors import ConfigError
from aligner_ext.support import MEGATRON_CORE_RELEASE, check_megatron_core

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("installed", ["0.19.0", "0.19.2", "0.19.3rc1"])
def test_a_version_of_the_release_passes(installed):
    check_megatron_core(installed)


@pytest.mark.parametrize("installed, found", [("0.16.1", "0.16.1 is installed"), ("0.20.0", "0.20.0 is installed"),
                                              ("1.19.0", "1.19.0 is installed"), ("", "it is not installed")])
def test_another_release_is_refused_in_one_line(installed, found):
    with pytest.raises(ConfigError) as err:
        check_megatron_core(installed)
    assert str(err.value) == (f"policy.backend=megatron needs megatron-core 0.19 ({found}): pip install "
                              "'aligner_ext[megatron]', under Python >= 3.12")


def test_the_release_is_the_one_the_megatron_extra_admits():
    pin = re.search(r'"megatron-core>=([\d.]+),<([\d.]+)"', (REPO / "setup.py").read_text())
    assert pin.groups() == (MEGATRON_CORE_RELEASE, "0.20")
