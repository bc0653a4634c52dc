"""The Python sandbox: each containment (time, processes, output, memory, network, files, environment)
holds against a program written to break it, a hung sandbox delays only itself, and where the
machine forbids the containment nothing runs. The limits are small so that each test is quick; a test
that expects a program to finish gives it a generous wall-clock limit, and the limit tests assert the
reason reported, never a duration."""

import ast
import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from aligner_ext.agents import sandbox
from aligner_ext.agents.sandbox import SandboxLimits, SandboxUnavailable, python_tool, run_python
from aligner_ext.agents.tool_calls import ToolCall
from aligner_ext.agents.tools import ToolRunner

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                                reason="the sandbox needs root on Linux (the CI machine runs as root)")
GENEROUS = SandboxLimits(wall_seconds=120, cpu_seconds=60)  # for programs that must run to their end
REPOSITORY = Path(__file__).resolve().parents[3]


def run(code: str, limits: SandboxLimits = GENEROUS):
    return asyncio.run(run_python(textwrap.dedent(code), limits))


def sandbox_processes(parent: int | None = None) -> list[int]:
    """Pids of live processes running as one of the sandbox uids of `parent` (this test process)."""
    first = sandbox.UID_BASE + (parent or os.getpid()) * sandbox.UIDS_PER_PROCESS
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except OSError:  # the process ended while being read
            continue
        uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
        if first <= uid < first + sandbox.UIDS_PER_PROCESS and state != "Z":  # a zombie holds nothing
            found.append(int(status.parent.name))
    return found


def wait_until(condition, seconds: float = 120) -> bool:
    """Poll `condition` until it holds; False if it still does not after `seconds` (a generous bound)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


ESCAPED_SLEEPER = """
import os, time
if os.fork() == 0:  # a child in a session of its own: a kill of the process group misses it
    os.setsid()
    time.sleep(1000)
"""


def test_a_program_runs_and_the_model_reads_its_output():
    result = run("print(sum(range(10)))")
    assert (result.stdout, result.stderr, result.returncode, result.limit) == ("45\n", "", 0, None)
    assert result.observation() == "45"
    assert run("").observation() == "(no output)"

    failed = run("x = 1\nx / 0\n").observation()
    assert failed.startswith('stderr:\nTraceback (most recent call last):\n  File "main.py", line 2, in <module>\n')
    assert failed.endswith("ZeroDivisionError: division by zero\n[exit status 1]")


def test_the_python_tool_is_described_to_the_model_and_run_by_the_tool_runner():
    runner = ToolRunner([python_tool(GENEROUS)], timeout_s=300)
    function = runner.schemas[0]["function"]
    assert function["name"] == "python"
    assert function["description"] == (
        "Run a Python 3 program and read what it prints to stdout and stderr.\n\n"
        "The program runs as a script in a fresh process without network access; print the values you\n"
        "want to see. It may write files in its working directory only. It is stopped after\n"
        "120 seconds or 8192 bytes of output.")
    assert function["parameters"] == {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "The complete program, as the text of a .py file."}}}
    result = asyncio.run(runner.call(ToolCall("python", {"code": "print(6 * 7)"})))
    assert (result.content, result.error) == ("42", None)


@pytest.mark.parametrize("limits, message", [
    (SandboxLimits(wall_seconds=1, cpu_seconds=60), "[stopped: the program ran out of time (1 s, or 60 s of CPU)]"),
    (SandboxLimits(wall_seconds=120, cpu_seconds=1), "[stopped: the program ran out of time (120 s, or 1 s of CPU)]"),
])
def test_an_infinite_loop_is_stopped_with_every_process_it_started(limits, message):
    """At the wall-clock limit (the launcher kills PID 1) or the CPU limit (the kernel does); a child
    that left the process group dies with the PID namespace."""
    result = run(ESCAPED_SLEEPER + "while True:\n    pass\n", limits)
    assert (result.limit, result.returncode) == ("timeout", -9)
    assert result.observation() == message
    assert sandbox_processes() == []


def test_the_process_count_is_limited_though_the_parent_is_root():
    """RLIMIT_NPROC 8 counts the program itself, so 7 children start and the 8th fork fails."""
    result = run("""
        import os, time
        children = 0
        try:
            for _ in range(50):
                if os.fork() == 0:
                    time.sleep(1000)
                children += 1
        finally:
            print(children)
    """, SandboxLimits(wall_seconds=120, cpu_seconds=60, max_processes=8))
    assert (result.stdout, result.limit) == ("7\n", "processes")
    assert result.stderr.endswith("BlockingIOError: [Errno 11] Resource temporarily unavailable\n")
    assert sandbox_processes() == []


def test_a_fork_bomb_is_contained():
    result = run("import os\nwhile True:\n    os.fork()\n", SandboxLimits(wall_seconds=120, cpu_seconds=60, max_processes=8))
    assert result.limit == "processes"
    assert result.observation().endswith("[stopped: the program tried to run more than 8 processes or threads]")
    assert sandbox_processes() == []


def test_a_huge_output_is_cut_and_never_held_by_the_parent():
    """300 MB written: the program is stopped once stdout passes the limit, and the parent's peak of
    Python allocations stays far below what the output would take."""
    tracemalloc.start()
    try:
        result = run("import sys\nfor _ in range(300):\n    sys.stdout.write('x' * 2**20)\n",
                     SandboxLimits(wall_seconds=120, cpu_seconds=60, output_bytes=1000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (result.stdout, result.limit) == ("x" * 1000, "output") and result.stdout_cut > 0
    assert peak < 20 * 2**20
    assert result.observation() == ("x" * 1000 + f"\n[{result.stdout_cut} more bytes cut: only the first 1000 are kept]"
                                    "\n[stopped: the program wrote more than 1000 bytes to stdout or stderr]")


def test_memory_is_limited():
    result = run("block = bytearray(2**30)\nprint('allocated')\n",
                 SandboxLimits(wall_seconds=120, cpu_seconds=60, memory_bytes=256 * 2**20))
    assert (result.stdout, result.limit) == ("", "memory")
    assert result.stderr.endswith("MemoryError\n")
    assert result.observation().endswith("[stopped: the program ran out of memory (256 MiB)]")


def test_there_is_no_network_not_even_the_machines_loopback():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0)
        result = run(f"""
            import socket
            print([name for _, name in socket.if_nameindex()])
            try:
                socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=5)
                print("connected")
            except OSError as err:
                print(type(err).__name__, err.errno)
        """)
        with pytest.raises(BlockingIOError):  # nothing came in
            listener.accept()
    assert result.stdout == "['lo']\nOSError 101\n"  # ENETUNREACH: the namespace's loopback is down


def test_writes_land_only_in_the_programs_own_directories_and_vanish_with_it(tmp_path):
    name = f"sandbox-probe-{uuid.uuid4().hex}"
    outside = [REPOSITORY / name, Path.home() / name, Path("/var/tmp") / name, tmp_path / name]
    inside = [Path(name), Path("/tmp") / name, Path("/dev/shm") / name]  # cwd is the program's /tmp
    result = run(f"""
        import ctypes, os
        print(sorted(os.listdir(".")), os.getcwd())
        ctypes.CDLL(None).mount(None, b"/", None, 0x20 | 0x1000, None)  # MS_REMOUNT | MS_BIND: read-write, if it could
        for path in {[str(path) for path in outside + inside]}:
            try:
                with open(path, "w") as file:
                    file.write("x")
                print("wrote", path)
            except OSError as err:
                print("refused", path, type(err).__name__)
    """)
    lines = result.stdout.splitlines()
    assert lines[0] == "['main.py'] /tmp"  # a fresh directory
    assert [line.split()[0] for line in lines[1:]] == ["refused"] * len(outside) + ["wrote"] * len(inside)
    assert not any(path.exists() for path in outside + [Path("/tmp") / name, Path("/dev/shm") / name])


def test_the_parents_environment_does_not_reach_the_program(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-4f1e")
    result = run("import os\nprint(sorted(os.environ))\nprint([pid for pid in os.listdir('/proc') if pid.isdigit()])")
    names, processes = map(ast.literal_eval, result.stdout.splitlines())
    assert "WANDB_API_KEY" not in names and "secret-4f1e" not in result.stdout
    assert processes == ["1"]  # its own /proc: the parent's processes (and their environments) are not there
    assert set(names) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
                                "PYTHONIOENCODING", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}


def test_a_hung_sandbox_delays_only_itself_and_cancelling_it_stops_it():
    async def both():
        hung = asyncio.create_task(run_python(ESCAPED_SLEEPER + "import time\ntime.sleep(1000)\n",
                                              SandboxLimits(wall_seconds=600, cpu_seconds=60)))
        quick = await run_python("print('done')", GENEROUS)
        hung_still_running = not hung.done()
        hung.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hung
        return quick, hung_still_running

    quick, hung_still_running = asyncio.run(both())
    assert quick.stdout == "done\n" and hung_still_running
    assert sandbox_processes() == []


def test_a_tool_runner_time_out_stops_the_program():
    """The runner's limit below the sandbox's: the runner cancels the call, and the cancelled call
    stops the program."""
    runner = ToolRunner([python_tool(SandboxLimits(wall_seconds=600, cpu_seconds=60))], timeout_s=0.5)
    result = asyncio.run(runner.call(ToolCall("python", {"code": ESCAPED_SLEEPER + "import time\ntime.sleep(1000)\n"})))
    assert (result.content, result.error) == ("Error: python did not finish within 0.5 s", "timeout")
    assert sandbox_processes() == []


def test_a_trainer_killed_with_sigkill_leaves_no_sandbox_behind():
    """The launcher dies with its parent (PR_SET_PDEATHSIG), PID 1 with the launcher, and the rest of
    the PID namespace (here a child in a session of its own) with PID 1."""
    program = ESCAPED_SLEEPER + "import time\ntime.sleep(1000)\n"
    script = ("import asyncio; from aligner_ext.agents.sandbox import SandboxLimits, run_python; "
              f"asyncio.run(run_python({program!r}, SandboxLimits(wall_seconds=600)))")
    trainer = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    try:
        assert wait_until(lambda: len(sandbox_processes(trainer.pid)) == 2)  # the program and its escaped child
    finally:
        trainer.kill()
        trainer.wait()
    assert wait_until(lambda: sandbox_processes(trainer.pid) == [])


def test_concurrent_sandboxes_get_uids_of_their_own():
    with sandbox._own_uid() as first, sandbox._own_uid() as second:
        assert first != second
        assert sandbox.UID_BASE <= min(first, second) and max(first, second) < 2**32 - 1  # (uid_t)-1 means "no uid"


def test_it_fails_closed_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="^the Python sandbox needs root on Linux .*; nothing was run$"):
        run("print(1)")


def test_it_fails_closed_where_namespaces_are_forbidden(tmp_path):
    """Root without CAP_SYS_ADMIN (dropped from the bounding set, as in a locked-down container) cannot
    make namespaces: one line, and the program (which would leave a file) never runs."""
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w')"
    script = f"import asyncio; from aligner_ext.agents.sandbox import run_python; asyncio.run(run_python({program!r}))"

    def drop_sys_admin():
        import ctypes
        ctypes.CDLL(None).prctl(24, 21, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_SYS_ADMIN

    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, preexec_fn=drop_sys_admin,
                           env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, timeout=120)
    assert child.returncode == 1 and not marker.exists()
    assert child.stderr.splitlines()[-1] == (
        "aligner_ext.agents.sandbox.SandboxUnavailable: the Python sandbox cannot contain a program on this machine "
        "([Errno 1] unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID): Operation not permitted); nothing was run")
