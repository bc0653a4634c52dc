"""Generation ahead of training on a generation server (the disaggregated placement: generator.engine=remote
with trainer.asynchronous, experience/ahead.py's ServedWeights) in tiny CPU runs through a local `aligner-ext
serve`: at max_staleness=0 the synchronous run through the same server, bit for bit; at 1 every later batch
sampled one version behind, the versions the server reported, the weights pushed between two batches; agent
episodes too, each turn a request."""

import itertools
import json
import math
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from aligner_ext.config import load_config
from aligner_ext.serving.server import GenerationServer, build_server
from aligner_ext.trainer import loop
from aligner_ext.trainer.loop import train
from served_engine import serve_in_thread
from small_run import SMALL_MODEL
from test_async_runs import assert_the_same_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = SMALL_MODEL + ["rollout.max_response_length=8", "trainer.export_hf=false", "trainer.tensorboard=false",
                       "trainer.log_samples_every=0", "policy.optim.lr=1e-3", "loss.importance_sampling_cap=2",
                       "+reward.sources.arithmetic=e2e_rewards.digit_fraction", "trainer.total_steps=3"]
AHEAD = ["trainer.asynchronous.enabled=true"]


@contextmanager
def serving_the_embedded_model(tmp_path, engine):
    """(the server, its URL): the embedded model on `engine`, taking weights from under tmp_path."""
    server = build_server(load_config("base", SMALL + [f"generator.engine={engine}", f"trainer.output_dir={tmp_path}",
                                                       "trainer.run_name=served", f"serve.weights_root={tmp_path}"]))
    with serve_in_thread(server) as url:
        yield server, url


@pytest.fixture
def server_url(tmp_path):
    with serving_the_embedded_model(tmp_path, "rollout") as served:
        yield served


def run(tmp_path, url, name, *extra):
    """A run through the server at `url` (its embedded model the server's: the same warm-up, cached)."""
    train(load_config("base", SMALL + [
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "generator.engine=remote",
        f"generator.remote.urls=[{url}]", "generator.remote.weight_sync=disk",
        f"generator.remote.weight_sync_dir={tmp_path / name / 'push'}", *extra]))
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return records, tmp_path / name


def test_staleness_zero_on_a_server_reproduces_the_synchronous_run_through_it(tmp_path, server_url):
    server, url = server_url
    steps = ["trainer.eval.every=2"]  # an evaluation mid-run, between two batches
    synchronous, sync_dir = run(tmp_path, url, "sync", *steps)  # first: the server starts on the loaded weights
    ahead, ahead_dir = run(tmp_path, url, "ahead", *steps, *AHEAD, "trainer.asynchronous.max_staleness=0")
    assert_the_same_run(synchronous, sync_dir, ahead, ahead_dir, steps=3)
    assert server.weight_version == 3  # the evaluation after the last step pushed the final policy


def test_staleness_one_on_a_server_trains_one_version_behind_the_versions_it_reported(tmp_path, server_url,
                                                                                      monkeypatch):
    """Step 2's batch is sampled after step 1's update has ended (the server holds its request until then),
    so a push by the loop after the update, rather than between two batches, would show in its version."""
    server, url = server_url
    generate, reported, refit, updated = GenerationServer.generate, [], loop.refit_engine, threading.Event()

    def after_the_first_update(served, *args):
        if len(reported) == 2:  # the evaluation before training, step 1's batch: this one is step 2's
            assert updated.wait(timeout=60)  # only a broken run waits this long
        answer = generate(served, *args)
        reported.append(answer["metadata"]["weight_version"])
        return answer

    def refit_then_say_so(parts):  # the loop's refit after each update
        refit(parts)
        updated.set()

    monkeypatch.setattr(GenerationServer, "generate", after_the_first_update)
    monkeypatch.setattr(loop, "refit_engine", refit_then_say_so)
    records, _ = run(tmp_path, url, "ahead", *AHEAD, "trainer.asynchronous.max_staleness=1")
    # one request per engine call (16 prompts): the evaluation before training, the three batches, the
    # evaluation after the last step, on the weights pushed before each
    assert reported == ["0", "0", "0", "1", "3"]
    steps = records[1:]
    # step 1's batch was sampled before any update; step 2's while step 1 trained (version 0, trained at 1),
    # step 3's on version 1 while step 2 trained
    assert [r["staleness/max"] for r in steps] == [0, 1, 1]
    assert [r.get("staleness/share_lag_1", 0.0) for r in steps] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(r["rollout/logprob_diff_mean_lag_1"]) for r in steps[1:])
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    assert server.weight_version == 3  # the evaluation after the last step pushed the final policy


def test_partial_rollouts_on_a_server_park_at_the_push_and_resume_under_the_new_weights(tmp_path, monkeypatch):
    """The batches of steps 2 and 3 are held on the server (the hf engine, polled after each decode step) at
    their third step until the trainer's refit aborts them (no timing): their first three tokens are
    sampled one version behind, the other five, resumed in a new request, under the weights they train at."""
    requests, held = [], {3, 5}  # in order: the evaluation, batch 1, batch 2, its resumption, batch 3, ...

    def held_at_the_third_step(server, cancelled, aborted):
        if aborted not in requests:
            requests.append(aborted)
            polls[aborted] = itertools.count(1)
        if requests.index(aborted) + 1 in held and next(polls[aborted]) == 3:
            assert aborted.wait(timeout=60)  # only a run whose refit does not abort the request waits this long
        return cancelled.is_set() or aborted.is_set()

    polls = {}
    monkeypatch.setattr(GenerationServer, "stop_wanted", held_at_the_third_step)
    with serving_the_embedded_model(tmp_path, "hf") as (server, url):
        records, _ = run(tmp_path, url, "partial", *AHEAD, "trainer.asynchronous.partial_rollouts=true",
                         "trainer.asynchronous.max_staleness=1", "rollout.ignore_eos=true")  # all 8 tokens long
    steps = records[1:]
    assert len(requests) == 7 and server.weight_version == 3  # the two resumptions; the last evaluation's push
    assert [r["async/parked_share"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1]
    assert [r.get("staleness/share_lag_1", 0.0) for r in steps] == [0.0, 3 / 8, 3 / 8]
    assert all(math.isfinite(r["rollout/logprob_diff_mean_lag_1"]) for r in steps[1:])
    assert all(r["actor/grad_norm"] > 0 for r in steps)


def test_agent_episodes_ahead_on_a_server_sample_each_turn_one_version_behind(tmp_path, server_url, monkeypatch):
    """Agent episodes generated ahead through the server: each turn a request of its own (no turn session on a
    server), every turn of a batch at the version pushed before it, the pushes between two batches only."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # e2e_environments (reward workers too)
    server, url = server_url
    generate, reported = GenerationServer.generate, []

    def recorded(served, *args):
        answer = generate(served, *args)
        reported.append(answer["metadata"]["weight_version"])
        return answer

    monkeypatch.setattr(GenerationServer, "generate", recorded)
    records, _ = run(tmp_path, url, "agents", *AHEAD, "trainer.asynchronous.max_staleness=1",
                     "algorithm.experience_maker=agent_episodes", "agents.environment=e2e_environments.CheckedRetry",
                     "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256", "rollout.max_response_length=24")
    steps = records[1:]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1]
    assert [r.get("staleness/share_lag_1", 0.0) for r in steps] == [0.0, 1.0, 1.0]
    assert all(1 <= r["agent/turns"] <= 2 for r in steps) and any(r["agent/turns"] > 1 for r in steps)
    assert reported == sorted(reported, key=int) and set(reported) <= {"0", "1", "2", "3"}  # versions never go back
    assert server.weight_version == 3  # the evaluation after the last step pushed the final policy
