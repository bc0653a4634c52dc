"""Model-written Python run in a separate process that cannot reach the machine, and the `python` tool.

`run_python(code, limits)` starts a launcher process (this module run as a script, as root), which
enters new mount, network and PID namespaces and forks the program's process, PID 1 there. Before
that process execs Python on the program it makes every mount read-only, mounts a fresh tmpfs on
/tmp (its working directory and HOME, `disk_bytes` large) and on /dev/shm, hides /root and /home
behind empty read-only tmpfs (the interpreter's own directories bound back read-only), mounts a /proc
showing its own processes only, sets the resource limits, and becomes an unprivileged uid of its own
with no_new_privs (setuid binaries give nothing back). So the program:

- has no network: its namespace holds only a loopback interface that is down;
- writes only to its own /tmp and /dev/shm, which vanish with its mount namespace;
- sees none of the parent's environment (a fixed environment of its own) nor its processes;
- runs at most `max_processes` processes and threads: RLIMIT_NPROC, which the kernel enforces for an
  unprivileged uid only (never for root), counted per uid, hence a uid per live sandbox;
- gets `memory_bytes` of address space and `cpu_seconds` of CPU time per process (RLIMIT_AS, RLIMIT_CPU);
- is stopped, with every process it started, at `wall_seconds` or when stdout or stderr passes
  `output_bytes`: the launcher kills PID 1 and the kernel kills the rest of its PID namespace; the
  launcher dies with the trainer (PR_SET_PDEATHSIG) and PID 1 with the launcher.

This needs root on Linux (namespaces, mounts, another uid). Where any step fails the sandbox fails
closed: `SandboxUnavailable`, one line naming the step, and nothing is run. Output is read in chunks
and kept up to the limit, so a huge output costs the parent `output_bytes` per stream, not more.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import resource
import select
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from aligner_ext.errors import UserError
from aligner_ext.rules import check_settings, number

LIMITS = ("timeout", "memory", "output", "processes")  # why a program was stopped (SandboxResult.limit)
MEMORY_EXIT, PROCESSES_EXIT = 201, 202  # the runner's exit status after an uncaught MemoryError / failed fork
UID_BASE, UIDS_PER_PROCESS = 1 << 30, 512  # uid = base + parent pid * 512 + slot: below 2**32 for any pid (< 2**22)
STOP_GRACE_S = 10.0  # how long the launcher may take to tear a stopped sandbox down before it is killed itself
HIDDEN_HOMES = ("/root", "/home")
PROGRAM_ENV = {  # the program's whole environment: nothing of the parent's (API keys, tokens) reaches it
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",  # threads count as processes
}
RUNNER = f"""
def _run_main_py():
    import sys, traceback, __main__
    __main__.__file__ = sys.argv[0] = "main.py"
    try:
        exec(compile(open("main.py").read(), "main.py", "exec"), __main__.__dict__)
    except Exception as error:  # as Python prints it, without this runner's frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit({MEMORY_EXIT} if isinstance(error, MemoryError) else {PROCESSES_EXIT} if isinstance(error, BlockingIOError) else 1)
_run_main_py()
"""  # what the program's interpreter runs: main.py as a script, with a distinct exit status for two limits
# The program's interpreter: the base installation, not the trainer's virtual environment, which may live
# under /tmp (a clone there), hidden by the program's own /tmp; the program has the standard library.
PROGRAM_PYTHON = getattr(sys, "_base_executable", None) or sys.executable


class SandboxUnavailable(UserError, RuntimeError):
    """The machine does not allow the sandbox's containment; nothing was run."""


@dataclass
class SandboxLimits:
    """What one program may use; past each limit it is stopped (or its call fails) and the reason reported."""

    wall_seconds: float = number(10.0, gt=0)  # wall-clock time from start to end, launcher and interpreter start-up included
    cpu_seconds: int = number(10, ge=1)  # CPU time per process, whole seconds (RLIMIT_CPU; PID 1 is killed a second later)
    memory_bytes: int = number(512 * 2**20, ge=64 * 2**20)  # address space per process (RLIMIT_AS); the interpreter itself needs ~30 MiB
    output_bytes: int = number(8192, ge=1)  # bytes kept of stdout and of stderr each; one more stops the program
    max_processes: int = number(16, ge=1)  # processes and threads at once, the first included (RLIMIT_NPROC)
    disk_bytes: int = number(64 * 2**20, ge=2**20)  # size of the program's /tmp and of its /dev/shm (tmpfs, in memory)


@dataclass
class SandboxResult:
    """One program's run: its output as kept, how it ended and, if a limit ended it, which."""

    stdout: str
    stderr: str
    returncode: int  # as subprocess gives it: negative when a signal ended the program
    limit: str | None  # one of LIMITS, or None
    stdout_cut: int  # bytes received past output_bytes and not kept
    stderr_cut: int
    limits: SandboxLimits

    def observation(self) -> str:
        """What the model reads: stdout, stderr under a heading, and a last line saying how it ended
        when that was not a plain success."""
        parts = [self.stdout + _cut_note(self.stdout_cut, self.limits)] if self.stdout or self.stdout_cut else []
        if self.stderr or self.stderr_cut:
            parts.append("stderr:\n" + self.stderr + _cut_note(self.stderr_cut, self.limits))
        if self.limit:
            parts.append(f"[stopped: {_limit_message(self.limit, self.limits)}]")
        elif self.returncode:
            parts.append(f"[exit status {self.returncode}]")
        return "\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"


def python_tool(limits: SandboxLimits | None = None) -> Callable[[str], Awaitable[str]]:
    """The `python` tool for ToolRunner, running each call in a sandbox under `limits`. Keep the runner's
    `timeout_s` above `wall_seconds`, so the model reads the sandbox's own report of a time-out."""
    limits = limits or SandboxLimits()
    check_settings(limits)

    async def python(code: str) -> str:
        return (await run_python(code, limits)).observation()

    python.__doc__ = f"""Run a Python 3 program and read what it prints to stdout and stderr.

        The program runs as a script in a fresh process without network access; print the values you
        want to see. It may write files in its working directory only. It is stopped after
        {limits.wall_seconds:g} seconds or {limits.output_bytes} bytes of output.

        Args:
            code: The complete program, as the text of a .py file.
        """
    return python


async def check_sandbox(limits: SandboxLimits | None = None) -> None:
    """Run an empty program: SandboxUnavailable at start-up instead of an error observation at every call."""
    await run_python("", limits)


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python script in a new sandbox; SandboxUnavailable when it cannot be contained.
    Cancelling the call stops the program."""
    limits = limits or SandboxLimits()
    check_settings(limits)
    if sys.platform != "linux" or os.geteuid() != 0:
        raise SandboxUnavailable("the Python sandbox needs root on Linux (to give the program namespaces and "
                                 "an unprivileged uid of its own); nothing was run")
    with _own_uid() as uid:
        status_read, status_write = os.pipe()
        try:
            launcher = await asyncio.create_subprocess_exec(
                sys.executable, "-S", "-s", "-m", __name__, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, pass_fds=(status_write,),
                start_new_session=True, cwd="/", env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        with open(status_read, "rb") as status:
            spec = {"code": code, "uid": uid, "status_fd": status_write, "parent_pid": os.getpid(), **vars(limits)}
            run = _Run(launcher, limits)
            (stdout, stdout_cut), (stderr, stderr_cut) = await run.until_done(json.dumps(spec).encode())
            report = [json.loads(line) for line in status.read().splitlines()]
    errors = [line["error"] for line in report if "error" in line]
    if errors or not report:
        raise SandboxUnavailable(f"the Python sandbox cannot contain a program on this machine "
                                 f"({errors[0] if errors else 'its launcher failed: ' + stderr.strip()[-300:]}); "
                                 "nothing was run")
    returncode, cpu_seconds = report[-1]["returncode"], report[-1]["cpu_seconds"]
    return SandboxResult(stdout, stderr, returncode, run.limit or _limit_of_exit(returncode, cpu_seconds, limits),
                         stdout_cut, stderr_cut, limits)


class _Run:
    """The parent's side of one sandbox: feeds the launcher its spec, reads both streams with a bound,
    and stops the sandbox at the wall-clock or output limit or when the caller is cancelled."""

    def __init__(self, launcher: asyncio.subprocess.Process, limits: SandboxLimits):
        self.launcher, self.limits = launcher, limits
        self.limit: str | None = None  # the limit the parent stopped the program for
        self.stopped = False

    async def until_done(self, spec: bytes) -> list[tuple[str, int]]:
        self.launcher.stdin.write(spec)
        self.launcher.stdin.close()
        done = asyncio.gather(self._read(self.launcher.stdout), self._read(self.launcher.stderr), self.launcher.wait())
        try:
            await asyncio.wait_for(asyncio.shield(done), self.limits.wall_seconds)
        except asyncio.TimeoutError:
            self.stop("timeout")
        except BaseException:  # cancelled: nothing may outlive the call
            self.stop(None)
            await self._ended()
            done.cancel()
            raise
        out, err, _ = await done
        return [out, err]

    def stop(self, limit: str | None) -> None:
        """Ask the launcher to kill the program and its PID namespace (it then reports and exits)."""
        if self.stopped:
            return
        self.limit, self.stopped = limit, True
        if self.launcher.returncode is None:  # os.kill: Popen.send_signal would poll, racing asyncio's reaper
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.launcher.pid, signal.SIGTERM)

    async def _ended(self) -> None:
        try:
            await asyncio.wait_for(self.launcher.wait(), STOP_GRACE_S)
        except BaseException:  # the launcher did not answer (or we are cancelled again): PID 1 dies with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
            raise

    async def _read(self, stream: asyncio.StreamReader) -> tuple[str, int]:
        """The stream's text up to output_bytes, and how many bytes came after it (read and dropped)."""
        kept, cut = bytearray(), 0
        while chunk := await stream.read(65536):
            room = self.limits.output_bytes - len(kept)
            kept += chunk[:room]
            if len(chunk) > room:
                cut += len(chunk) - room
                self.stop("output")
        return kept.decode("utf-8", errors="replace"), cut


_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()


@contextlib.contextmanager
def _own_uid():
    """A uid no other live sandbox has, so that RLIMIT_NPROC counts this sandbox's processes only."""
    with _uids_lock:
        slot = next((slot for slot in range(UIDS_PER_PROCESS) if slot not in _uids_in_use), None)
        if slot is None:
            raise RuntimeError(f"more than {UIDS_PER_PROCESS} Python sandboxes at once in one process")
        _uids_in_use.add(slot)
    try:
        yield UID_BASE + os.getpid() * UIDS_PER_PROCESS + slot
    finally:
        with _uids_lock:
            _uids_in_use.discard(slot)


def _limit_of_exit(returncode: int, cpu_seconds: float, limits: SandboxLimits) -> str | None:
    """The limit a program ran into by itself: a MemoryError or failed fork the runner reports, or the
    CPU limit. At the soft CPU limit the kernel sends SIGXCPU, which PID 1 of a namespace ignores, and
    at the hard one (a second later) SIGKILL, after `cpu_seconds` for sure."""
    if returncode == MEMORY_EXIT:
        return "memory"
    if returncode == PROCESSES_EXIT:
        return "processes"
    if returncode == -signal.SIGKILL and cpu_seconds >= limits.cpu_seconds:
        return "timeout"
    return None


def _limit_message(limit: str, limits: SandboxLimits) -> str:
    return {"timeout": f"the program ran out of time ({limits.wall_seconds:g} s, or {limits.cpu_seconds:g} s of CPU)",
            "memory": f"the program ran out of memory ({limits.memory_bytes / 2**20:g} MiB)",
            "output": f"the program wrote more than {limits.output_bytes} bytes to stdout or stderr",
            "processes": f"the program tried to run more than {limits.max_processes} processes or threads"}[limit]


def _cut_note(cut: int, limits: SandboxLimits) -> str:
    return f"\n[{cut} more bytes cut: only the first {limits.output_bytes} are kept]" if cut else ""


# The launcher: this module run as a script (`python -m aligner_ext.agents.sandbox`) as root, one per program.

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x2000, 0x4000, 0x40000
KEPT_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}  # kept when made read-only
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_libc = ctypes.CDLL(None, use_errno=True)


def launch() -> None:
    """Read the spec from stdin, enter new namespaces, run the program as PID 1 there, wait for it and
    write its exit status and CPU time (or why it could not run) as JSON lines on the status pipe."""
    spec = json.loads(sys.stdin.buffer.read())
    os.set_inheritable(spec["status_fd"], False)  # closed when the program execs: it cannot write a report
    status = os.fdopen(spec["status_fd"], "w")
    _call(_libc.prctl, "prctl(PR_SET_PDEATHSIG)", PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent_pid"]:  # the parent went before the line above
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until the program's pid is known
    try:
        _call(_libc.unshare, "unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)",
              CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
        launcher_alive, launcher_alive_write = os.pipe()  # EOF for the program when the launcher is gone
        pid = os.fork()
    except OSError as err:
        status.write(json.dumps({"error": str(err)}) + "\n")
        return
    if pid == 0:
        os.close(launcher_alive_write)
        _become_program(spec, status, launcher_alive)

    def stop_program(*_):  # the parent's stop
        with contextlib.suppress(ProcessLookupError):  # ended already
            os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop_program)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _, wait_status, usage = os.wait4(pid, 0)  # returns once every process of the PID namespace is gone
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # pid is no longer the program's
    status.write(json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status),
                             "cpu_seconds": usage.ru_utime + usage.ru_stime}) + "\n")


def _become_program(spec: dict, status, launcher_alive: int) -> None:
    """In PID 1 of the new namespaces, still root: contain, then exec the interpreter on the program."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _contain_files(spec["disk_bytes"])
        Path("/tmp/main.py").write_text(spec["code"], "utf-8", "surrogatepass")  # a lone surrogate: the program's error
        for limit, value in [(resource.RLIMIT_AS, spec["memory_bytes"]), (resource.RLIMIT_NPROC, spec["max_processes"]),
                             (resource.RLIMIT_CORE, 0)]:
            resource.setrlimit(limit, (value, value))
        resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_seconds"], spec["cpu_seconds"] + 1))  # _limit_of_exit
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
        _call(_libc.prctl, "prctl(PR_SET_NO_NEW_PRIVS)", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _call(_libc.prctl, "prctl(PR_SET_PDEATHSIG)", PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by setuid
        if select.select([launcher_alive], [], [], 0)[0]:  # the launcher died before the line above
            os._exit(1)
        os.chdir("/tmp")
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.execve(PROGRAM_PYTHON, [PROGRAM_PYTHON, "-s", "-B", "-c", RUNNER], PROGRAM_ENV)
    except BaseException as err:
        status.write(json.dumps({"error": str(err)}) + "\n")
        status.flush()
        os._exit(127)


def _contain_files(disk_bytes: int) -> None:
    """Every mount read-only in this mount namespace; writable tmpfs on /tmp and /dev/shm; homes hidden;
    a /proc of this PID namespace."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing below may propagate to the machine's mounts
    for point, options in _mounts():
        flags = sum(flag for name, flag in KEPT_MOUNT_FLAGS.items() if name in options)
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except FileNotFoundError:  # under a later mount: out of reach anyway
            continue
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=1777")
    _hide_homes()
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=1777")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _hide_homes() -> None:
    """An empty read-only tmpfs over /root and /home (secrets such as ~/.netrc live there), with the
    interpreter's directories under them (a venv, a pyenv install) bound back read-only."""
    needed = {os.path.realpath(path) for path in (sys.prefix, sys.base_prefix)}
    for home in HIDDEN_HOMES:
        if not os.path.isdir(home):
            continue
        kept = sorted(path for path in needed if path.startswith(home + "/"))
        kept = [path for path in kept if not any(path.startswith(other + "/") for other in kept)]
        stashes = [f"/tmp/.kept{index}" for index in range(len(kept))]
        for path, stash in zip(kept, stashes):
            os.mkdir(stash)
            _mount(path, stash, None, MS_BIND | MS_REC)
        _mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for path, stash in zip(kept, stashes):
            os.makedirs(path)
            _mount(stash, path, None, MS_MOVE)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            os.rmdir(stash)
        _mount(None, home, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of each mount of this mount namespace."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape[1], 8)), fields[4])
        mounts.append((point, set(fields[5].split(","))))
    return mounts


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    what = (f"remount {target}" if flags & MS_REMOUNT else f"mount {fstype} on {target}" if fstype
            else f"move or bind {source} to {target}" if source else f"make the mounts under {target} private")
    _call(_libc.mount, what, *(text.encode() if text else None for text in (source, target, fstype)), flags,
          data.encode() if data else None)


def _call(function, what: str, *args) -> None:
    """A libc call; OSError (its errno's subclass) naming the step when it fails."""
    if function(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


if __name__ == "__main__":
    launch()
