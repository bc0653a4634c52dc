"""Prepare what a benchmark on the lent GPU machine carries: the packages setup.py asks for (its
requirements and the --extras named) that the GPU machine lacks, or has at a version the requirement
excludes, with what they need in turn, checked against that machine's package list
(scripts/bench/gpu_packages.txt, its `pip list --format=freeze`).

    python scripts/prepare_gpu_carry.py [--extras megatron,liger,bench]

Each missing package is fetched as a wheel for the GPU machine's Python and platform (PYTHON, PLATFORMS), at
the version docker/constraints.txt pins where it pins one (megatron-core 0.19.2;
a package with no wheel is built here, and kept only if pure Python). Wheels with compiled code go to
.whl/ (scripts/bench/gpu.sh installs them there), pure-Python ones are unpacked into .devsite/ (put on
its path). Both folders are emptied first, are git-ignored, and must fit, with the working tree, in
the 64 MiB a device call carries: the script prints the sizes and fails over that.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
GPU_PACKAGES = ROOT / "scripts" / "bench" / "gpu_packages.txt"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"  # a package the suite passed with is carried at that version
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
CARRY_LIMIT = 64 * 2**20
# the GPU machine's environment, for requirement markers (`; python_version < "3.11"`, `; sys_platform == ...`)
MARKERS = {**default_environment(), "python_version": PYTHON, "python_full_version": f"{PYTHON}.3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def setup_requirements(extras: list[str]) -> list[Requirement]:
    """install_requires and the named extras_require of setup.py, read from its source."""
    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    arguments = {keyword.arg: keyword.value for keyword in call.keywords}
    names = ast.literal_eval(arguments["install_requires"])
    optional = ast.literal_eval(arguments["extras_require"])
    return [Requirement(text) for text in names + [text for extra in extras for text in optional[extra]]]


def gpu_packages() -> dict[str, str]:
    """name -> version on the GPU machine."""
    lines = [line.split("==") for line in GPU_PACKAGES.read_text().splitlines() if "==" in line]
    return {canonicalize_name(name): version for name, version in lines}


def fetch(requirement: Requirement, into: Path) -> Path:
    """One wheel of `requirement` (no dependencies) for the GPU machine, else one built here."""
    before, wanted = set(into.iterdir()), requirement.name + str(requirement.specifier)
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                "--python-version", PYTHON, "--implementation", "cp", "-d", str(into), "-c", str(CONSTRAINTS), wanted]
    download += [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    if subprocess.run(download, capture_output=True).returncode != 0:  # no wheel: build one (pure Python only)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(into), wanted],
                       check=True, capture_output=True)
    [wheel] = set(into.iterdir()) - before
    return wheel


def needs(wheel: Path) -> list[Requirement]:
    """The Requires-Dist of a wheel that apply on the GPU machine (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    found = [Requirement(line.removeprefix("Requires-Dist:").strip()) for line in text.splitlines()
             if line.startswith("Requires-Dist:")]
    return [r for r in found if r.marker is None or r.marker.evaluate({**MARKERS, "extra": ""})]


def missing(requirement: Requirement, installed: dict[str, str]) -> bool:
    """Whether the GPU machine lacks `requirement` (absent, or at a version it excludes)."""
    version = installed.get(canonicalize_name(requirement.name))
    return version is None or not requirement.specifier.contains(version, prereleases=True)


def collect(extras: list[str], into: Path) -> list[Path]:
    """Every wheel the GPU machine is missing, dependencies followed only below a missing package."""
    installed = gpu_packages()
    queue = [r for r in setup_requirements(extras) if r.marker is None or r.marker.evaluate(MARKERS)]
    fetched: dict[str, Path] = {}
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in fetched or not missing(requirement, installed):
            continue
        fetched[name] = fetch(requirement, into)
        print(f"  {fetched[name].name}  (for {requirement})")
        queue += needs(fetched[name])
    return list(fetched.values())


def pure(wheel: Path) -> bool:
    """A wheel of Python code only (its ABI tag none, its platform any)."""
    return wheel.name.endswith("-none-any.whl")


def tree_size() -> int:
    """Bytes of what a device call sends besides the carried folders: tracked and untracked files
    that git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extras", default="megatron,liger,bench", help="extras of setup.py to carry too")
    args = parser.parse_args()
    wheels, site = ROOT / ".whl", ROOT / ".devsite"
    for folder in (wheels, site):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    with tempfile.TemporaryDirectory() as scratch:
        print(f"missing on the GPU machine ({GPU_PACKAGES.name}):")
        for wheel in collect([extra for extra in args.extras.split(",") if extra], Path(scratch)):
            if pure(wheel):
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(site)
            else:
                shutil.copy(wheel, wheels)
    sizes = {".whl": folder_size(wheels), ".devsite": folder_size(site), "the working tree": tree_size()}
    print(", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))
    if sum(sizes.values()) > CARRY_LIMIT:
        sys.exit(f"over the {CARRY_LIMIT // 2**20} MiB a device call carries")


if __name__ == "__main__":
    main()
