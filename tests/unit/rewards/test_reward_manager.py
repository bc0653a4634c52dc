"""RewardManager: choosing the function by data_source, worker processes, fallbacks, time limits."""

import logging
import os
from pathlib import Path

import pytest

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.manager import MAX_LOGS_PER_ERROR, RewardConfig, RewardManager, RewardSourceError

HELPERS = "reward_helper_fns"  # tests/unit/rewards/reward_helper_fns.py, loaded by dotted path


@pytest.fixture(autouse=True)
def _helpers_on_path(monkeypatch):
    """Put the helper module's folder on sys.path, as a user puts their module there; workers inherit it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def row(data_source, ground_truth=None, index=0, **extra_info):
    return PromptRow(row_id=f"test.jsonl:{index}", messages=[{"role": "user", "content": "q"}],
                     data_source=data_source, ground_truth=ground_truth, extra_info=extra_info)


def is_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_builtin_sources_score_in_workers():
    rows = [row("arithmetic", "19"), row("arithmetic", "19"), row("short_qa", "red"), row("multiple_choice", "B")]
    responses = ["\\boxed{19}", "\\boxed{20}", "\\boxed{The Red.}", "Answer: C"]
    with RewardManager(RewardConfig()) as manager:
        results = manager.score(responses, rows)
        assert [(r.score, r.correct) for r in results] == [(1.0, 1.0), (0.0, 0.0), (1.0, 1.0), (0.0, 0.0)]
        assert manager.metrics() == {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0,
                                     "reward/fallback_fraction": 0.0}
        assert manager.score([], []) == []


def test_check_imports_every_named_function_and_refuses_a_source_no_row_carries():
    rows = [row("arithmetic", "19"), row("short_qa", "red", index=1)]
    RewardManager(RewardConfig(sources={"short_qa": f"{HELPERS}:count_words"})).check(rows)
    with pytest.raises(RewardSourceError, match=r"^reward.sources.arithmetc: no data row carries data_source "
                                                r"'arithmetc' \(did you mean 'arithmetic'\? the rows carry arithmetic, "
                                                r"short_qa\)$"):
        RewardManager(RewardConfig(sources={"arithmetc": "exact_match"})).check(rows)
    with pytest.raises(RewardSourceError, match=r"reward 'no_such_module:score' for data_source 'short_qa' "
                                                r"\(reward.sources.short_qa\): cannot import module 'no_such_module'"):
        RewardManager(RewardConfig(sources={"short_qa": "no_such_module:score"})).check(rows)
    with pytest.raises(RewardSourceError, match=r"\(reward.default\): module 'reward_helper_fns' has no attribute"):
        RewardManager(RewardConfig(default=f"{HELPERS}:no_such_function")).check(rows)


def test_sources_override_the_builtin_table_and_load_dotted_paths():
    cfg = RewardConfig(sources={"arithmetic": "exact_match", "custom": f"{HELPERS}:count_words"})
    with RewardManager(cfg) as manager:
        results = manager.score(["\\boxed{1/2}", "one two three"], [row("arithmetic", "0.5"), row("custom")])
    assert (results[0].score, results[0].correct) == (0.0, 0.0)  # exact_match: "1/2" != "0.5" (math_verify: 1)
    assert (results[1].score, results[1].correct) == (3.0, None)  # a float return: no notion of correctness


def test_default_scores_data_sources_in_no_table():
    with RewardManager(RewardConfig(default="exact_match")) as manager:
        results = manager.score(["\\boxed{Paris}"], [row("geography", "paris")])
    assert results[0].score == 1.0


def test_unknown_data_source_is_a_config_error_raised_before_any_call(tmp_path):
    marker = tmp_path / "ran"
    cfg = RewardConfig(sources={"custom": f"{HELPERS}:touch_marker"})
    with RewardManager(cfg) as manager:
        with pytest.raises(ValueError) as err:
            manager.score(["a", "b"], [row("custom", marker=str(marker)), row("nope", index=1)])
    message = str(err.value)
    assert "'nope'" in message and "test.jsonl:1" in message
    for known in ("arithmetic", "custom", "multiple_choice", "short_qa"):
        assert known in message
    assert not marker.exists()  # the valid first row was not scored either


@pytest.mark.parametrize("name, expected", [
    ("no_such_reward", "unknown reward function 'no_such_reward'"),
    (f"{HELPERS}:no_such_fn", "has no attribute 'no_such_fn'"),
    ("no_such_module:fn", "cannot import module 'no_such_module'"),
])
def test_unresolvable_reward_name_is_a_config_error(name, expected):
    with RewardManager(RewardConfig(sources={"x": name})) as manager:
        with pytest.raises(ValueError, match="data_source 'x'") as err:
            manager.score(["a"], [row("x")])
    assert expected in str(err.value)


def test_raising_function_falls_back_and_is_counted_and_logged_a_few_times(caplog):
    cfg = RewardConfig(sources={"boom": f"{HELPERS}:raise_error"}, fallback_score=-1.0)
    rows = [row("boom", index=i) for i in range(5)] + [row("arithmetic", "2", index=5)]
    with RewardManager(cfg) as manager, caplog.at_level(logging.WARNING, logger="aligner_ext.rewards.manager"):
        results = manager.score(["x"] * 5 + ["\\boxed{2}"], rows)
        for result in results[:5]:
            assert (result.score, result.correct) == (-1.0, 0.0)
            assert result.info == {"fallback": "error", "error": "ValueError: cannot score this row"}
        assert (results[5].score, results[5].correct) == (1.0, 1.0)
        # 5 fallbacks of 6 calls
        assert manager.metrics() == {"reward/num_errors": 5.0, "reward/num_timeouts": 0.0,
                                     "reward/fallback_fraction": 5 / 6}
        assert manager.metrics()["reward/num_errors"] == 0.0  # counts restart after each read
    logged = [r.getMessage() for r in caplog.records if "cannot score this row" in r.getMessage()]
    assert len(logged) == MAX_LOGS_PER_ERROR < 5
    assert "'boom'" in logged[0] and "test.jsonl:0" in logged[0]


def test_bad_returns_and_dying_workers_fall_back_and_the_pool_recovers():
    cfg = RewardConfig(sources={"text": f"{HELPERS}:return_text", "nan": f"{HELPERS}:return_nan",
                                "exit": f"{HELPERS}:exit_worker", "ok": f"{HELPERS}:count_words"}, num_workers=1)
    with RewardManager(cfg) as manager:
        results = manager.score(["a", "a", "a", "a b"], [row("text"), row("nan"), row("exit"), row("ok")])
        errors = [r.info["error"] for r in results[:3]]
        assert errors[0].startswith("TypeError") and "returned str" in errors[0]
        assert errors[1].startswith("ValueError") and "finite" in errors[1]
        assert errors[2].startswith("WorkerDied") and "exit code 3" in errors[2]
        assert results[3].score == 2.0  # scored by the replacement of the worker that exited
        assert manager.metrics()["reward/num_errors"] == 3.0


def test_each_call_has_its_own_time_limit():
    """Three 0.6 s calls in a row on one worker: 1.8 s in all, but each is within the 1.5 s limit."""
    cfg = RewardConfig(sources={"slow": f"{HELPERS}:sleep_then_score"}, timeout_s=1.5, num_workers=1)
    with RewardManager(cfg) as manager:
        results = manager.score(["a"] * 3, [row("slow", index=i, sleep_s=0.6) for i in range(3)])
        assert [r.score for r in results] == [1.0, 1.0, 1.0]
        assert manager.metrics()["reward/num_timeouts"] == 0.0


def test_hung_call_times_out_and_its_worker_is_killed_and_replaced(tmp_path, caplog):
    pid_file = tmp_path / "pid"
    cfg = RewardConfig(sources={"slow": f"{HELPERS}:sleep_then_score", "ok": f"{HELPERS}:count_words"},
                       timeout_s=1.0, fallback_score=-0.5, num_workers=1)
    with RewardManager(cfg) as manager, caplog.at_level(logging.WARNING, logger="aligner_ext.rewards.manager"):
        # one worker: the second call can only run if the hung first one is killed and replaced
        results = manager.score(["a", "b c"], [row("slow", index=7, sleep_s=30, pid_file=str(pid_file)), row("ok")])
        assert (results[0].score, results[0].correct) == (-0.5, 0.0)
        assert results[0].info == {"fallback": "timeout", "timeout_s": 1.0}
        assert results[1].score == 2.0
        assert not is_alive(int(pid_file.read_text()))
        assert manager.metrics() == {"reward/num_errors": 0.0, "reward/num_timeouts": 1.0,
                                     "reward/fallback_fraction": 0.5}
        assert manager.score(["d e f"], [row("ok")])[0].score == 3.0  # the next call runs normally
    warning = next(r.getMessage() for r in caplog.records if "limit" in r.getMessage())
    assert "'slow'" in warning and "test.jsonl:7" in warning and "1.0 s" in warning


def test_close_stops_the_workers():
    with RewardManager(RewardConfig(sources={"pid": f"{HELPERS}:worker_pid"})) as manager:
        pid = int(manager.score(["a"], [row("pid")])[0].score)
        assert is_alive(pid)
    assert not is_alive(pid)


def test_a_reward_beyond_float32_falls_back_instead_of_becoming_inf():
    cfg = RewardConfig(sources={"huge": f"{HELPERS}:return_beyond_float32"}, num_workers=1, fallback_score=-1.0)
    with RewardManager(cfg) as manager:
        result = manager.score(["a"], [row("huge")])[0]
    assert result.score == -1.0 and result.info["error"].startswith("ValueError") and "float32" in result.info["error"]


@pytest.mark.parametrize("field, value", [("timeout_s", 0.0), ("num_workers", 0), ("fallback_score", float("nan")),
                                          ("fallback_score", float("inf")), ("fallback_score", 1e39)])
def test_invalid_limits_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        RewardManager(RewardConfig(**{field: value}))


def test_start_runs_the_workers_before_the_first_score_and_close_stops_them():
    manager = RewardManager(RewardConfig(num_workers=2))
    manager.start()  # in a background thread: wait (bounded) for it to have started the processes
    manager._starting.join(timeout=60)
    pids = [worker.process.pid for worker in manager._pool.workers]
    assert len(pids) == 2 and all(is_alive(pid) for pid in pids)  # running before any score call
    manager.start()  # a second start keeps the same workers
    assert [worker.process.pid for worker in manager._pool.workers] == pids
    results = manager.score(["\\boxed{19}"], [row("arithmetic", "19")])
    assert [worker.process.pid for worker in manager._pool.workers] == pids  # scoring used the started ones
    assert results[0].score == 1.0
    manager.close()
    assert not any(is_alive(pid) for pid in pids)


def test_a_verl_compute_score_scores_in_the_workers_as_it_is():
    cfg = RewardConfig(sources={"gsm8k": f"{HELPERS}:verl_compute_score"})
    with RewardManager(cfg) as manager:
        results = manager.score(["so 42", "so 41"], [row("gsm8k", "42"), row("gsm8k", "42", index=1)])
    assert [(r.score, r.correct) for r in results] == [(1.0, 1.0), (-1.0, 0.0)]
    assert results[0].info["pid"] != os.getpid()  # scored in a worker process
