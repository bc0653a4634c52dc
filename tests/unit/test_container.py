"""docker/constraints.txt pins every requirement the Dockerfile installs (setup.py's install_requires,
the megatron and dev extras; torch is the base image's), and the Dockerfile installs under it."""

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
