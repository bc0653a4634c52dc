"""The benchmark tests' child processes compute with one thread."""

import pytest


@pytest.fixture(autouse=True)
def _one_compute_thread(monkeypatch):
    """The benchmark scripts these tests start compute with one thread, as the suite's other child processes
    do: torch's threads spin while they wait for each other, and beside the other test worker on 2 cores
    two of them made a CPU run several times slower (aligner_ext/threads.py)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
