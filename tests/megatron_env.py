"""megatron-core for the tests where the suite's own environment cannot have it: megatron-core 0.19 needs
Python >= 3.12, `.venv` is Python 3.11. A test module that asks for megatron-core
(`pytest.importorskip("megatron.core")` or `importorskip("aligner_ext.models.megatron...")`), collected where
megatron-core 0.19 is not installed, runs whole in `.venv312` (Python 3.12, megatron-core 0.19; made once by
scripts/setup_megatron_env.sh under a file lock), as one test of the suite: `ModuleInMegatronEnv`
(tests/conftest.py). Modules of under a couple of minutes share one `.venv312` pytest (`batches`): each
process spends about 10 s importing torch and megatron-core before its first test. Under
`.venv312/bin/python -m pytest` the same modules run as usual.

No Python 3.12 on the machine: those tests skip with the reason, except under `ALIGNER_EXT_CI=1` (.ci/run), where
the Megatron backend's tests must run, so they fail with it."""

import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aligner_ext.errors import ConfigError
from aligner_ext.support import check_megatron_core

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv312"
ASKS_FOR_MEGATRON = re.compile(r'importorskip\("(megatron\.core|aligner_ext\.models\.megatron)')
NO_PYTHON_312 = 3  # scripts/setup_megatron_env.sh's exit status
# Seconds each module took on 2 cores beside another worker (2026-11-30, rounded), only to pack and order the
# batches: a module not listed counts as DEFAULT_SECONDS, and a wrong number costs balance, never a test.
SECONDS_IN_CI = {
    "test_family_runs.py": 200, "test_megatron_lora.py": 133, "test_megatron_loop_layouts.py": 131,
    "test_diverging_run.py": 98, "test_megatron_train_loop.py": 97, "test_megatron_tp_pp.py": 97,
    "test_megatron_rollout.py": 82, "test_async_remote_megatron.py": 80, "test_dist_checkpoint.py": 76,
    "test_runs_that_cannot_learn.py": 62, "test_megatron_agent_episodes.py": 59, "test_multi_gpu.py": 50,
    "test_families.py": 39, "test_megatron_routing.py": 37, "test_moe_ep_gpus.py": 34, "test_sliding_window.py": 24,
    "test_planted_checkpoint.py": 23, "test_megatron_families.py": 19, "test_unsupported_model.py": 17,
    "test_support.py": 15, "test_process_groups.py": 15, "test_checkpoint_from_0_16.py": 13,
    "test_megatron_convert_cli.py": 8, "test_megatron_convert.py": 3, "test_moe.py": 2, "test_grouped_experts.py": 1,
    "test_models_doc.py": 1,
}
DEFAULT_SECONDS = 20
BATCH_SECONDS = 150  # modules are packed into one process up to this many seconds (a longer one runs alone)


class MissingPython312(Exception):
    """No Python 3.12 to build the environment with (the set-up script's line)."""


def _supported_megatron_core_here() -> bool:
    try:
        check_megatron_core()
    except ConfigError:  # none, or another release (a .venv made before the backend moved to 0.19)
        return False
    return True


MEGATRON_HERE = _supported_megatron_core_here()


def runs_elsewhere(path: Path) -> bool:
    """A test module asking for megatron-core, where the release the backend runs on is not installed."""
    return not MEGATRON_HERE and bool(ASKS_FOR_MEGATRON.search(path.read_text()))


def megatron_python(output=None) -> Path:
    """The environment's python, built first if needed (one process builds it; the others wait); the
    build's output goes to `output` (a file), else to stderr."""
    with open(ROOT / ".venv312.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = subprocess.run(["bash", str(ROOT / "scripts" / "setup_megatron_env.sh"), str(VENV)],
                               stdout=output or sys.stderr, stderr=subprocess.PIPE, text=True)
    if build.returncode == NO_PYTHON_312:
        raise MissingPython312(build.stderr.strip())
    assert build.returncode == 0, f"scripts/setup_megatron_env.sh failed:\n{build.stderr[-6000:]}"
    return VENV / "bin" / "python"


class ModuleFailed(Exception):
    """A test of the module failed in .venv312 (its pytest output)."""


def first_report(output: str, limit: int = 6000) -> str:
    """The first failure's or error's report in a pytest output: where a module fixture fails, every test of the
    module errors, and the end of the output is their one-line summaries, not the traceback that says why."""
    starts = [output.find(header) for header in ("= ERRORS =", "= FAILURES =") if header in output]
    return output[min(starts):][:limit] if starts else ""


class ModuleInMegatronEnv(pytest.File):
    """A test module run whole by `.venv312`'s pytest, as one item (until `batches` packs it with others)."""

    def collect(self):
        yield ModuleRun.from_parent(self, name="in_venv312", paths=[self.path])


def packed(paths: list[Path]) -> list[list[Path]]:
    """`paths` packed first-fit, longest first, into groups of at most BATCH_SECONDS in all (by
    SECONDS_IN_CI; a longer module alone), the groups longest first: fewer processes to start, and the
    longest start first where the suite ends with them."""
    def seconds(path: Path) -> int:
        return SECONDS_IN_CI.get(path.name, DEFAULT_SECONDS)

    groups: list[list[Path]] = []
    for path in sorted(paths, key=lambda path: -seconds(path)):
        fits = next((group for group in groups if sum(map(seconds, group)) + seconds(path) <= BATCH_SECONDS), None)
        if fits is None:
            groups.append([path])
        else:
            fits.append(path)
    return groups


def batches(runs: list["ModuleRun"]) -> list["ModuleRun"]:
    """The one-module items of `runs` as one item per `packed` group, named after its first module and
    listing the others."""
    by_path = {run.path: run for run in runs}
    merged = []
    for first, *others in packed(list(by_path)):
        if not others:
            merged.append(by_path[first])
            continue
        name = "in_venv312_with_" + "+".join(other.stem for other in others)
        merged.append(ModuleRun.from_parent(by_path[first].parent, name=name, paths=[first, *others]))
    return merged


class ModuleRun(pytest.Item):
    """The modules' tests in `.venv312` (one process), under this run's marker expression (`-m`); its outcome
    is theirs: failed if one failed, skipped (with their reasons) if all were."""

    def __init__(self, *, paths: list[Path], **kwargs):
        super().__init__(**kwargs)
        self.paths = paths
        self.add_marker(pytest.mark.timeout(0))  # each of its tests keeps pytest.ini's limit in there

    def runtest(self):
        try:
            python = megatron_python()
        except MissingPython312 as err:
            if os.environ.get("ALIGNER_EXT_CI") == "1":
                pytest.fail(str(err), pytrace=False)
            pytest.skip(str(err))
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *map(str, self.paths)]
        if self.config.option.markexpr:
            command += ["-m", self.config.option.markexpr]
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        names = ", ".join(path.name for path in self.paths)
        if run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED:  # every test deselected by `-m`
            pytest.skip(f"{names} in .venv312: {summary}")
        if run.returncode != 0:
            raise ModuleFailed(f"{names} in .venv312: {summary}\n{first_report(run.stdout)}\n...\n"
                               f"{run.stdout[-4000:]}{run.stderr[-3000:]}")
        if " passed" not in summary:  # every test skipped there: say why, as the tests themselves would
            pytest.skip("; ".join(line for line in run.stdout.splitlines() if line.startswith("SKIPPED")))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ModuleFailed):  # the module's own report, not this item's traceback
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{', '.join(path.name for path in self.paths)} in .venv312"
