"""RewardManager: score responses with each row's reward function, in worker processes, with time limits.

Which function scores a row: `RewardConfig.sources[row.data_source]`, else the built-in table
`DATA_SOURCES` (filled by `register_reward`), else `RewardConfig.default`. The name resolves through
`REWARDS`: a registered name or a dotted path `pkg.module:fn`. A data_source found nowhere, or a
name that does not resolve, is a config error raised before any call runs.

How calls run: a pool of `num_workers` processes, each with its own pipe and one call at a time.
A call's clock starts when it is sent to an idle worker; the manager waits on all pipes with the
earliest deadline as the timeout. So the limit is per call and exact, and nothing can crash a run:
- a call still running after `timeout_s` gets `fallback_score`; its worker is killed and replaced
  by a new one, so later calls never queue behind it, and calls on the other workers carry on;
- a call that raises, returns something other than a RewardResult or a finite number, or whose
  worker dies, gets `fallback_score`.
Every fallback is counted (`metrics()`) and logged as a WARNING naming the reward, data_source and
row. Errors are logged at most `MAX_LOGS_PER_ERROR` times per (reward, exception type), not per
message: messages often quote the row's data, so a broken dataset would log every row. A fallback
result has `correct=0.0` whether or not the function reports correctness (it counts as wrong in
accuracy) and `info={"fallback": "timeout" | "error", ...}`.

Decisions:
- Our own pool rather than `concurrent.futures.ProcessPoolExecutor`: the executor cannot kill one
  worker (a timeout would mean tearing down the whole pool and re-running the calls in flight on
  the others), and it marks a call as running when it is queued, not when it starts, so per-call
  deadlines would be inexact.
- Start method "forkserver", preloading `aligner_ext.rewards`: `fork` is unsafe in a trainer that
  runs torch / OpenMP / CUDA threads (a child can inherit a lock held by a thread that does not
  exist in it). Forkserver, like spawn, starts from a fresh interpreter, but then forks each worker
  from a server that has already imported the reward modules (sympy, torch through the row types),
  so replacing a killed worker takes milliseconds instead of a fresh import. As with spawn, each
  worker re-imports the trainer's main module (`__main__`), so a script must guard its entry point
  with `if __name__ == "__main__":`.
- Functions travel pickled by reference (module and name), so the worker imports the user's module
  itself. Workers get the trainer's `sys.path` when they start (at the first `score`, and on each
  replacement): a module importable in the trainer then is importable in the workers.
- One call per message, no chunking. Measured on the 2-core development machine: 256 `math_verify`
  calls on short responses take 0.22-0.30 s through the pool (about 1 ms each, of which the pool's
  messaging is about 0.08 ms), well under the ~1 s a training step can spend on rewards.
- `metrics()` returns the counts since the previous `metrics()` call, i.e. per training step.
- Workers die with the trainer, however it dies (a SIGKILL during a hung call included):
  `_die_with_trainer`. An orphaned worker would spin on and keep the run's output open.
- Run-level reward settings (the LLM judge, `judge`) reach a reward object through one hook: a
  resolved reward that has `with_reward_config(cfg)` is replaced by what that returns, once per
  data_source. Plain functions are used as they are.
- Under torchrun (`split_across_ranks`, on by default) each process runs a contiguous share of a
  `score` call's calls in its own pool and the raw outcomes are all-gathered
  (`distributed.map_split`) before fallbacks are counted, so every process returns the same results
  and the same `metrics()`, and each response is scored once per run instead of once per process
  (an LLM judge gets one request per item, not one per process). A reward that is not deterministic
  (a sampling judge) would otherwise even give the processes different batches.
"""

from __future__ import annotations

import ctypes
import difflib
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections import Counter, deque
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from aligner_ext.data.types import PromptRow
from aligner_ext.distributed import map_split
from aligner_ext.errors import UserError
from aligner_ext.rewards import exact_match, format, math_answer, multiple_choice  # noqa: F401 - register the built-in functions
from aligner_ext.rewards.base import DATA_SOURCES, REWARDS, RewardResult, as_result, is_trainable_score
from aligner_ext.rewards.settings import RewardConfig
from aligner_ext.rewards.verl_score import adapt

logger = logging.getLogger(__name__)

MAX_LOGS_PER_ERROR = 3  # log lines per (reward, exception type); every occurrence is counted
STARTUP_TIMEOUT_S = 120.0  # how long a new worker may take to start, seconds
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal this process gets when its parent exits


class RewardSourceError(UserError, ValueError):
    """A row's data_source has no reward function, or its function does not resolve."""


def _worker_main(conn: Connection, trainer_pid: int) -> None:
    """Worker loop: receive a pickled (fn, response, row), send back a pickled outcome (see `_call`).

    It ends quietly (status 0, no traceback) however the pool goes away: the manager's end closed while
    the worker waits (EOFError), while it replies (BrokenPipeError) or with a reply left unread
    (ConnectionResetError; any OSError of the pipe), or a KeyboardInterrupt (Ctrl-C is ignored here, but a
    module a reward imports may install its own handler). SIGTERM (the pool's processes stopped at the
    trainer's exit, a job scheduler stopping the process group) ends it with the default action: at once,
    with no Python-level handler that could print.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which closes the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_trainer(trainer_pid)
    _one_compute_thread()
    try:
        conn.send_bytes(b"ready")
        while True:
            payload = conn.recv_bytes()
            conn.send_bytes(_call(payload))
    except (EOFError, OSError, KeyboardInterrupt):  # the pool is going away (docstring)
        return


def _one_compute_thread() -> None:
    """A worker scores with one thread: the trainer's threads have the cores (aligner_ext/threads.py)."""
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # libraries imported later
        os.environ[variable] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _die_with_trainer(trainer_pid: int) -> None:
    """Make this worker exit when the trainer does, even a SIGKILLed one whose reward call hangs: else it
    would spin on at 100% CPU holding the run's files open. Two guards, as neither covers every case:
    - PR_SET_PDEATHSIG: the kernel SIGKILLs the worker when its parent, the forkserver, exits, whatever
      the worker is doing (a C loop holding the GIL included). The forkserver exits once every copy of
      its pipe from the trainer is closed; each worker inherits one, which it closes here, so the trainer's
      death is what closes the last one. Linux only.
    - a thread that waits on a pidfd of the trainer (Linux >= 5.3) and ends the process when the trainer
      exits: for when the forkserver outlives it (another child of the trainer, forked, holds that pipe)."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "prctl"):
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    server = forkserver._forkserver  # the stdlib keeps the pipe's fd there, unexposed; closed after the prctl,
    # so the forkserver (which this copy keeps alive) cannot have exited before the signal was armed
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None  # a forkserver started from this worker would make its own
    try:
        trainer = os.pidfd_open(trainer_pid)
    except ProcessLookupError:  # the trainer died while this worker started
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: the parent-death signal alone
        return

    def watch() -> None:
        select.select([trainer], [], [])  # readable once the trainer has exited
        os._exit(1)

    threading.Thread(target=watch, name="reward-worker-watchdog", daemon=True).start()


def _call(payload: bytes) -> bytes:
    """("ok", RewardResult) or ("error", (exception type name, message)), pickled."""
    try:
        fn, response, row = pickle.loads(payload)
        return pickle.dumps(("ok", as_result(fn(response, row))))
    except Exception as err:  # whatever the user's function does wrong becomes a counted fallback
        return pickle.dumps(("error", (type(err).__name__, str(err))))


class _Worker:
    """One worker process and the manager's end of its pipe."""

    def __init__(self, ctx: Any):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_conn, os.getpid()), name="reward-worker",
                                   daemon=True)
        self.process.start()
        child_conn.close()

    def wait_ready(self) -> None:
        """Block until the worker has started; raise RuntimeError if it exits or takes too long."""
        try:
            if self.conn.poll(STARTUP_TIMEOUT_S) and self.conn.recv_bytes() == b"ready":
                return
        except (EOFError, OSError):  # it exited while starting (EOF, or a reset if it had written)
            exitcode = self.stop()
            raise RuntimeError(f"reward worker exited with code {exitcode} while starting; it re-imports the "
                               "main module, so a script must start training under `if __name__ == '__main__':`")
        self.stop()
        raise RuntimeError(f"reward worker did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def stop(self) -> int | None:
        """Kill the process (if still running) and return its exit code."""
        self.process.kill()
        self.process.join()
        self.conn.close()
        return self.process.exitcode


class _WorkerPool:
    """`num_workers` processes, one call each at a time; a hung or dead worker is replaced."""

    def __init__(self, num_workers: int):
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["aligner_ext.rewards"])  # ignored if the server already runs
        self.workers = [_Worker(self._ctx) for _ in range(num_workers)]
        self._started = False  # every worker has said it is ready

    def wait_started(self) -> None:
        """Block until every worker has started (once); stop them all and raise if one fails to."""
        if self._started:
            return
        try:
            for worker in self.workers:
                worker.wait_ready()
        except RuntimeError:
            self.close()
            raise
        self._started = True

    def run(self, payloads: list[bytes], timeout_s: float) -> list[tuple[str, Any]]:
        """Run every call; each outcome is ("ok", RewardResult), ("error", (type, message)) or ("timeout", None)."""
        outcomes: list[Any] = [None] * len(payloads)
        todo = deque(range(len(payloads)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, time the call was sent)
        while todo or busy:
            for slot in range(len(self.workers)):
                if slot not in busy and todo:
                    index = todo.popleft()
                    self._send(slot, payloads[index])
                    busy[slot] = (index, time.monotonic())
            deadline = min(start for _, start in busy.values()) + timeout_s
            timeout = max(0.0, deadline - time.monotonic())
            ready = wait([self.workers[slot].conn for slot in busy], timeout=timeout)
            for slot in [slot for slot in busy if self.workers[slot].conn in ready]:
                outcomes[busy.pop(slot)[0]] = self._receive(slot)
            now = time.monotonic()
            for slot in [slot for slot, (_, start) in busy.items() if now - start >= timeout_s]:
                outcomes[busy.pop(slot)[0]] = ("timeout", None)
                self._replace(slot)
        return outcomes

    def _send(self, slot: int, payload: bytes) -> None:
        try:
            self.workers[slot].conn.send_bytes(payload)
        except OSError:  # the worker died while idle (killed from outside): replace it and send again
            self._replace(slot)
            self.workers[slot].conn.send_bytes(payload)

    def _receive(self, slot: int) -> tuple[str, Any]:
        try:
            return pickle.loads(self.workers[slot].conn.recv_bytes())
        except (EOFError, OSError):  # the worker died during the call (os._exit, a crash, the OOM killer)
            exitcode = self._replace(slot)
            return ("error", ("WorkerDied", f"the worker process died during the call (exit code {exitcode})"))

    def _replace(self, slot: int) -> int | None:
        """Kill the worker in `slot`, start a fresh one there; return the old one's exit code."""
        exitcode = self.workers[slot].stop()
        self.workers[slot] = _Worker(self._ctx)
        self.workers[slot].wait_ready()
        return exitcode

    def close(self) -> None:
        """Stop every worker: idle ones exit on EOF, any other is killed after a second."""
        for worker in self.workers:
            worker.conn.close()  # an idle worker reads EOF and exits
        for worker in self.workers:
            worker.process.join(timeout=1.0)
            worker.process.kill()  # no-op for one that has exited
            worker.process.join()


class RewardManager:
    """Scores responses in worker processes (see the module docstring); close() or a `with` block stops them."""

    def __init__(self, cfg: RewardConfig):
        if cfg.timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {cfg.timeout_s}")
        if cfg.num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {cfg.num_workers}")
        if not is_trainable_score(cfg.fallback_score):
            raise ValueError(f"reward fallback_score must be a finite float32 number, got {cfg.fallback_score}")
        self.cfg = cfg
        self._functions: dict[str, tuple[str, Callable[..., Any]]] = {}  # data_source -> (reward name, function)
        self._pool: _WorkerPool | None = None
        self._starting: threading.Thread | None = None  # start()'s thread, until the pool exists
        self._start_error: BaseException | None = None
        self._counts: Counter[str] = Counter()  # "calls", "error", "timeout" since the last metrics()
        self._times_logged: Counter[tuple[str, str]] = Counter()  # (reward name, exception type) -> log lines

    def score(self, responses: list[str], rows: list[PromptRow]) -> list[RewardResult]:
        """Score `responses[i]` against `rows[i]`; one result per response, fallbacks included."""
        if len(responses) != len(rows):
            raise ValueError(f"score got {len(responses)} responses for {len(rows)} rows")
        functions = [self._resolve(row) for row in rows]  # config errors surface before any call runs
        if not rows:
            return []
        calls = [(fn, text, row) for (_, fn), text, row in zip(functions, responses, rows)]
        outcomes = map_split(self._run, calls) if self.cfg.split_across_ranks else self._run(calls)
        self._counts["calls"] += len(rows)
        return [value if status == "ok" else self._fallback(status, value, row, name)
                for (status, value), row, (name, _) in zip(outcomes, rows, functions)]

    def start(self) -> None:
        """Start the worker processes in a background thread: called at the end of the build, their
        start-up (the forkserver's imports, seconds, which a process start waits for) overlaps the first
        generation instead of delaying the first scoring."""
        if self._pool is None and self._starting is None:
            self._starting = threading.Thread(target=self._create_pool, name="reward-workers-start", daemon=True)
            self._starting.start()

    def _create_pool(self) -> None:
        try:
            self._pool = _WorkerPool(self.cfg.num_workers)
        except BaseException as err:  # raised again by the first score
            self._start_error = err

    def _started_pool(self) -> _WorkerPool:
        """The pool, once start()'s thread has made it and every worker is ready."""
        self.start()
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._start_error is not None:
            error, self._start_error = self._start_error, None
            raise error
        self._pool.wait_started()
        return self._pool

    def _run(self, calls: list[tuple[Callable[..., Any], str, PromptRow]]) -> list[tuple[str, Any]]:
        """The outcomes (see `_WorkerPool.run`) of (function, response, row) calls, in this process's pool."""
        if not calls:
            return []
        pool = self._started_pool()
        try:
            return pool.run([pickle.dumps(call) for call in calls], self.cfg.timeout_s)
        except BaseException:  # e.g. Ctrl-C: replies still in flight must not reach the next score()
            self.close()
            raise

    def metrics(self) -> dict[str, float]:
        """Counts since the previous metrics() call: errors, timeouts and the fraction of calls that fell back."""
        calls, errors, timeouts = self._counts["calls"], self._counts["error"], self._counts["timeout"]
        self._counts.clear()
        return {
            "reward/num_errors": float(errors),
            "reward/num_timeouts": float(timeouts),
            "reward/fallback_fraction": (errors + timeouts) / calls if calls else 0.0,
        }

    def close(self) -> None:
        """Stop the workers; a later score() starts new ones."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def check(self, rows: list[PromptRow]) -> None:
        """Before the model loads (the run calls this once its data has loaded): import every function the
        reward config names, refuse a `sources` entry that no row carries (a misspelt data_source would
        leave its rows on another reward), and resolve the reward function of every data_source in `rows`,
        so that an unknown source in a late row does not stop a run hours in."""
        carried = {row.data_source for row in rows}
        for source, name in self.cfg.sources.items():
            self._load(name, source, f"reward.sources.{source}")
            if source not in carried:
                close = difflib.get_close_matches(source, sorted(carried), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise RewardSourceError(f"reward.sources.{source}: no data row carries data_source {source!r} "
                                        f"({hint}the rows carry {', '.join(sorted(carried))})")
        if self.cfg.default is not None:
            self._load(self.cfg.default, "(any other)", "reward.default")
        for row in {row.data_source: row for row in reversed(rows)}.values():  # each source's first row
            self._resolve(row)

    def reward_names(self, rows: list[PromptRow]) -> dict[str, str]:
        """{data_source: the reward function's name} over `rows` (the run's start-up summary)."""
        return {source: self._resolve(row)[0] for source, row in {row.data_source: row for row in rows}.items()}

    def extracts_answer(self, row: PromptRow) -> bool:
        """Whether the row's reward function reports the answer it compared (`RewardResult.answer`, rewards/base.py)."""
        return bool(getattr(self._resolve(row)[1], "extracts_answer", False))

    def _resolve(self, row: PromptRow) -> tuple[str, Callable[..., Any]]:
        """(reward name, function) for the row's data_source; raise ValueError naming what is missing."""
        source = row.data_source
        if source not in self._functions:
            name = self._reward_name(source, row.row_id)
            self._functions[source] = (name, self._load(name, source, f"row {row.row_id}"))
        return self._functions[source]

    def _load(self, name: str, source: str, where: str) -> Callable[..., Any]:
        """The reward function `name` (registered or `pkg.module:fn`), ready for the workers; a RewardSourceError
        naming `where` (a row, or the setting) if it does not import, is not a function or takes neither our
        arguments nor verl's."""
        try:
            fn = adapt(REWARDS.get(name))  # a verl compute_score is wrapped to take (response, row)
            if hasattr(fn, "with_reward_config"):
                fn = fn.with_reward_config(self.cfg)
            pickle.dumps(fn)  # workers receive it by reference: a lambda or nested function cannot go
        except (KeyError, ImportError, AttributeError, ValueError, TypeError, pickle.PicklingError) as err:
            raise RewardSourceError(f"reward {name!r} for data_source {source!r} ({where}): {err}") from err
        if not callable(fn):
            raise RewardSourceError(f"reward {name!r} for data_source {source!r} ({where}) is a {type(fn).__name__}, "
                                    "not a function")
        return fn

    def _reward_name(self, source: str, row_id: str) -> str:
        if source in self.cfg.sources:
            return self.cfg.sources[source]
        if source in DATA_SOURCES:
            return DATA_SOURCES[source]
        if self.cfg.default is not None:
            return self.cfg.default
        known = ", ".join(sorted({*DATA_SOURCES, *self.cfg.sources}))
        raise RewardSourceError(f"row {row_id}: no reward function for data_source {source!r}; known data_sources: "
                         f"{known}; map it in the reward config's `sources` or set its `default`")

    def _fallback(self, kind: str, error: tuple[str, str] | None, row: PromptRow, name: str) -> RewardResult:
        """Count and log a failed call (`error` is (exception type, message) for kind "error"); the fallback result."""
        self._counts[kind] += 1
        where = f"reward {name!r} on data_source {row.data_source!r}, row {row.row_id}"
        fallback = self.cfg.fallback_score
        if kind == "timeout":
            logger.warning("%s: no result within the %.1f s limit; its worker was killed and replaced; score %s",
                           where, self.cfg.timeout_s, fallback)
            return RewardResult(fallback, 0.0, {"fallback": "timeout", "timeout_s": self.cfg.timeout_s})
        error_type, message = error
        key = (name, error_type)
        self._times_logged[key] += 1
        if self._times_logged[key] <= MAX_LOGS_PER_ERROR:
            last = self._times_logged[key] == MAX_LOGS_PER_ERROR
            note = f" (logged {MAX_LOGS_PER_ERROR} times; further {error_type}s are only counted)" if last else ""
            logger.warning("%s failed: %s: %s; score %s%s", where, error_type, message, fallback, note)
        return RewardResult(fallback, 0.0, {"fallback": "error", "error": f"{error_type}: {message}"})
