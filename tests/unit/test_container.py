"""docker/constraints.txt pins every requirement the Dockerfile installs (setup.py's install_requires,
the megatron and dev extras; torch is installed before them), and the Dockerfile installs under it, on a
base whose Python megatron-core 0.19 accepts."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def requirement_names(text: str) -> set[str]:
    """Names in setup.py's install_requires and its megatron and dev extras."""
    wanted = re.search(r"install_requires=\[(.*?)\]", text, re.S).group(1)
    extras = re.search(r"extras_require=\{(.*?)\n    \}", text, re.S).group(1)
    for extra in ("megatron", "dev"):
        wanted += re.search(rf'"{extra}": \[(.*?)\]', extras).group(1)
    return {re.split(r"[<>=!~\[ ]", spec)[0].lower().replace("_", "-") for spec in re.findall(r'"([^"]+)"', wanted)}


def test_every_requirement_is_pinned_in_the_constraints():
    pins = {}
    for line in (REPO / "docker" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    required = requirement_names((REPO / "setup.py").read_text()) - {"torch"}
    assert {"transformers", "megatron-core", "openai", "fastapi"} <= required  # the parse found the lists
    assert sorted(required - pins.keys()) == []


def test_the_dockerfile_installs_under_the_constraints():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "COPY docker/constraints.txt" in dockerfile
    assert re.search(r'pip install .*-c docker/constraints.txt .*"\.\[dev,megatron\]"', dockerfile)


def test_the_image_has_python_3_12_and_the_measured_torch_before_the_project():
    """megatron-core 0.19 needs Python >= 3.12 (pytorch/pytorch's release images have 3.11): Ubuntu 24.04's;
    torch 2.11 with CUDA 13.0, the benchmarks' build, installed before the project so that pip keeps it."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM ubuntu:24\.04$", dockerfile, re.M)
    torch_at = dockerfile.index("pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130")
    assert torch_at < dockerfile.index('-e ".[dev,megatron]"')
    assert "sys.version_info >= (3, 12)" in dockerfile
