"""Process groups are made once per process and layout (models/megatron/parallel.py): torch frees
none, and collectives slow down as they pile up, which once made a long test launch run past its
limit. Checked under torchrun by groups_worker.py."""

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_cases import torchrun  # noqa: E402


def test_a_layout_or_partition_made_again_reuses_its_groups():
    torchrun([str(Path(__file__).with_name("groups_worker.py"))], timeout=300)
