"""Shared fixtures: the built-in character tokenizer, a very small Llama-architecture model, and a
factory of minimal experience batches."""

import atexit
import os
import shutil
import tempfile
import threading

import pytest
import torch

from triton_interpreter import use_on_cpu

use_on_cpu()  # Triton kernels run in Triton's interpreter without a GPU (before anything imports Triton)
# Warmed embedded models are cached per machine (models/warmup_cache.py): the suite keeps its own, shared
# by its subprocesses, instead of the user's.
# Only the process that makes it (pytest's own, before its workers start) removes it, at exit.
if "ALIGNER_EXT_CACHE" not in os.environ:
    os.environ["ALIGNER_EXT_CACHE"] = tempfile.mkdtemp(prefix="aligner_ext_test_cache_")
    atexit.register(shutil.rmtree, os.environ["ALIGNER_EXT_CACHE"], ignore_errors=True)

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptRow
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from megatron_env import ModuleInMegatronEnv, ModuleRun, batches, megatron_python, runs_elsewhere

_builds: list[threading.Thread] = []


def pytest_pycollect_makemodule(module_path, parent):
    """A module asking for megatron-core where it does not import runs whole in .venv312 (tests/megatron_env.py)."""
    if runs_elsewhere(module_path):
        return ModuleInMegatronEnv.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` deselected theirs
def pytest_collection_modifyitems(items):
    """The modules that run in .venv312, packed into batches (the longest first), after the first tenth of the
    other modules, and the tests against a real vLLM last: the environments build in the background from
    `pytest_collection_finish` while the first modules run, rather than hold a worker waiting, and the many
    short modules after the batches even out the two workers' ends (a batch is minutes long)."""
    rest = sorted((item for item in items if not isinstance(item, ModuleRun)),
                  key=lambda item: item.path.name == "test_real_vllm.py")  # stable: the others keep their order
    modules = list(dict.fromkeys(item.path for item in rest))
    first = modules[len(modules) // 10] if modules else None
    cut = next((index for index, item in enumerate(rest) if item.path == first), len(rest))
    items[:] = rest[:cut] + batches([item for item in items if isinstance(item, ModuleRun)]) + rest[cut:]


def _build_in_background(session, name: str, build) -> None:
    """`build(output=log)` in a thread, its output in `<root>/<name>.build.log` (not on the console: the tests'
    own call builds it again and reports a failure)."""

    def run():
        try:
            with open(os.path.join(session.config.rootpath, f"{name}.build.log"), "w") as log:
                build(output=log)
        except Exception:  # noqa: BLE001 - the tests build it again and report the failure
            pass

    thread = threading.Thread(target=run, name=f"{name}-build", daemon=True)
    thread.start()
    _builds.append(thread)


def pytest_collection_finish(session):
    """Build the real-vLLM environment (minutes of downloads and unpacking, tests/real_vllm.py) and the
    megatron-core one (tests/megatron_env.py) in the background as soon as a test that needs it is collected,
    so that it overlaps the tests before it; the tests' own call waits on the build's file lock, and raises
    whatever the build raised."""
    if any(item.path.name == "test_real_vllm.py" for item in session.items):
        from real_vllm import vllm_python

        _build_in_background(session, ".venv-vllm", vllm_python)
    if any(isinstance(item, ModuleRun) for item in session.items):
        _build_in_background(session, ".venv312", megatron_python)


def pytest_sessionfinish(session):
    for thread in _builds:
        thread.join()  # never leave a half-built environment behind


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh 2-layer model in float32, eval mode; tests that train it get their own copy."""
    model = build_tiny_model(tiny_tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                             num_kv_heads=1, intermediate_size=64, seed=0))
    return model.eval()


@pytest.fixture
def widths_padded_on_the_cpu(monkeypatch):
    """The CPU padded as a GPU is (aligner_ext/widths.py pads on GPUs only), to check the pads are exact."""
    import aligner_ext.widths

    monkeypatch.setattr(aligner_ext.widths, "PADDED_DEVICE_TYPES", ("cuda", "cpu"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def make_batch():
    """A factory for ExperienceBatch objects carrying only a response mask and the fields a test sets:
    make(response_mask, advantages=None, old_logprobs=None, ref_logprobs=None, group_ids=None, rewards=None)."""

    def make(response_mask, advantages=None, old_logprobs=None, ref_logprobs=None, group_ids=None, rewards=None):
        mask = torch.as_tensor(response_mask, dtype=torch.bool)
        rows, width = mask.shape
        return ExperienceBatch(
            prompt_ids=torch.ones(rows, 1, dtype=torch.long),
            prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
            response_ids=torch.ones(rows, width, dtype=torch.long),
            response_valid=mask.clone(),
            response_mask=mask,
            group_ids=torch.arange(rows) if group_ids is None else torch.as_tensor(group_ids),
            samples=[SampleInfo(row=PromptRow(row_id=f"test:{i}", messages=[], data_source="test"))
                     for i in range(rows)],
            rewards=None if rewards is None else torch.as_tensor(rewards, dtype=torch.float32),
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
        )

    return make
