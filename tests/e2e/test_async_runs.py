"""Generation ahead of training (trainer.asynchronous, experience/ahead.py) in tiny CPU runs: at
max_staleness=0 the synchronous run bit for bit; at 1 every later batch one version behind, within the
bound, and a run SIGKILLed while a checkpoint holding a batch made ahead is written resumes from the one before
as if never stopped, no prompt repeated or skipped; with partial rollouts, batches parked at the
trainer's refit and resumed under its new weights, each token's staleness its own, dynamic sampling's refills
and MTPO's two rounds included."""

import itertools
import json
import math
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

from aligner_ext.config import load_config
from aligner_ext.data.loader import build_loader
from aligner_ext.experience.dynamic_sampling import DynamicSampling
from aligner_ext.experience.two_round import TwoRoundSampling
from aligner_ext.generation.resumable import ResumableEngine
from aligner_ext.models.tiny import build_char_tokenizer
from aligner_ext.trainer import loop
from aligner_ext.trainer.checkpoint import STATE_FILE, Checkpointer, load_trainer_state
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL, train_in_child

pytestmark = pytest.mark.slow

SMALL = SMALL_MODEL + ["rollout.max_response_length=8", "trainer.export_hf=false", "trainer.tensorboard=false",
                       "trainer.log_samples_every=0", "policy.optim.lr=1e-3", "loss.importance_sampling_cap=2",
                       "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]  # a dense reward: every step learns
AHEAD = ["trainer.asynchronous.enabled=true"]


def run(tmp_path, name, *extra):
    train(load_config("base", SMALL + [f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", *extra]))
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return records, tmp_path / name


def weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def learning_metrics(record):
    """Everything but the clocks and generation ahead's own counters."""
    return {key: value for key, value in record.items() if not key.startswith(("timing/", "async/"))}


def test_staleness_zero_reproduces_the_synchronous_run_bit_for_bit(tmp_path):
    steps = ["trainer.total_steps=3", "trainer.eval.every=2"]  # an evaluation mid-run, between two batches
    synchronous, sync_dir = run(tmp_path, "sync", *steps)
    ahead, ahead_dir = run(tmp_path, "ahead", *steps, *AHEAD, "trainer.asynchronous.max_staleness=0")
    assert_the_same_run(synchronous, sync_dir, ahead, ahead_dir, steps=3)


def assert_the_same_run(synchronous, sync_dir, ahead, ahead_dir, steps):
    """The run ahead (its metrics records and directory) is the synchronous one: the same metrics but the
    clocks, every token at staleness 0, the same weights after `steps` steps, which all moved them."""
    assert [learning_metrics(r) for r in ahead] == [learning_metrics(r) for r in synchronous]
    assert all(r["staleness/max"] == 0 for r in ahead[1:])
    expected, got = weights(sync_dir, steps), weights(ahead_dir, steps)
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert all(r["actor/grad_norm"] > 0 for r in synchronous[1:])


class Interrupted(Exception):
    """Stops a run right after it saved a checkpoint, batches in flight (as a kill would)."""


def interrupted_at_the_first_save(tmp_path, monkeypatch, caplog, name, *overrides, first=None, then=None):
    """Run `name` with `first` (default RESUMED) until it saved its first checkpoint, stopping it there; returns
    generation ahead's log lines while resuming it with `then` (default RESUMED) and `overrides`, its metrics
    records and its directory."""
    save = loop.save

    def save_then_stop(cfg, parts, checkpointer, step, before, **kwargs):
        save(cfg, parts, checkpointer, step, before, **kwargs)
        raise Interrupted  # the batches made ahead are in flight: the checkpoint holds them

    monkeypatch.setattr(loop, "save", save_then_stop)
    with pytest.raises(Interrupted):
        run(tmp_path, name, *(RESUMED if first is None else first))
    monkeypatch.setattr(loop, "save", save)
    caplog.set_level("INFO", logger="aligner_ext.experience.ahead")
    caplog.clear()
    records, run_dir = run(tmp_path, name, *(RESUMED if then is None else then), *overrides)  # resumes from step 2
    return [r.getMessage() for r in caplog.records if r.name == "aligner_ext.experience.ahead"], records, run_dir


SAVED_AT_2_OF_4 = ["trainer.total_steps=4", "trainer.save_every=2", "trainer.log_samples_every=1",
                   "trainer.num_log_samples=16"]  # every sample of every step
RESUMED = [*AHEAD, "trainer.asynchronous.max_staleness=1", *SAVED_AT_2_OF_4]


# Killed while saving: step_2's writer (in the background, trainer.async_save) stops after the trainer state,
# and step 3's log kills the process once it has stopped (bounded, so a run where no writer starts fails)
WRITER_STOPS_AT_STEP_2 = """
import threading
import aligner_ext.trainer.checkpoint as c
from aligner_ext.trainer.metrics import MetricsLogger
stopped = threading.Event()
real_write, real_log = c._write_from_memory, MetricsLogger.log
def write(tmp, step, files):
    if step == 2:
        (tmp / c.STATE_FILE).write_bytes(files[c.STATE_FILE])
        stopped.set()
        threading.Event().wait()
    real_write(tmp, step, files)
def log(self, step, metrics):
    real_log(self, step, metrics)
    if step == 3:
        if not stopped.wait(timeout=120):
            sys.exit(3)
        kill()
c._write_from_memory = write
MetricsLogger.log = log
"""
SAVED_EVERY_STEP = [*AHEAD, "trainer.asynchronous.max_staleness=1", "trainer.total_steps=4", "trainer.save_every=1",
                    "trainer.keep_last=0", "trainer.log_samples_every=1", "trainer.num_log_samples=16"]


def test_a_run_killed_while_saving_batches_made_ahead_resumes_as_if_never_stopped(tmp_path, caplog):
    """k = 1, SIGKILLed while step_2 is written in the background, one batch made ahead in each checkpoint: the
    previous checkpoint stays `latest` and whole, and the same command resumes from it to the uninterrupted run,
    bit for bit, each step's prompts the stream's next four. Step 3 trains and is logged while step_2's write
    cannot finish: a background save does not hold training up. Nothing waits on time (the patch waits on the
    event the writer sets when it stops) and both runs start one compute thread (small_run.py)."""
    killed = train_in_child([*SMALL, *SAVED_EVERY_STEP, f"trainer.output_dir={tmp_path}", "trainer.run_name=killed"],
                            WRITER_STOPS_AT_STEP_2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir, checkpoints = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2, 3]  # step 3 trained while step_2's write could not finish
    assert sorted(path.name for path in checkpoints.iterdir()) == [".step_2.tmp", "latest", "step_1"]
    assert [path.name for path in (checkpoints / ".step_2.tmp").iterdir()] == [STATE_FILE]
    assert (checkpoints / "latest").read_text() == "step_1"
    Checkpointer(run_dir, keep_last=0).verify(checkpoints / "step_1")
    # each checkpoint holds the next step's batch, made ahead while its step trained: one version behind
    for checkpoint, step in ((checkpoints / "step_1", 1), (checkpoints / ".step_2.tmp", 2)):
        ready = load_trainer_state(checkpoint / STATE_FILE)["maker"]["ready"]
        assert [saved["step"] for saved in ready] == [step]  # counted from 0: the step after `step`
        batch = ready[0]["batch"]
        assert batch.generation_versions[batch.sampled].unique().tolist() == [step - 1]

    caplog.set_level("INFO")
    records, run_dir = run(tmp_path, "killed", *SAVED_EVERY_STEP)
    assert "resumed from" in caplog.text and "step_1 (step 1)" in caplog.text
    assert not [r for r in caplog.records if r.name == "aligner_ext.experience.ahead"]  # nothing dropped or regenerated
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step_1", "step_2", "step_3", "step_4"]
    assert (checkpoints / "latest").read_text() == "step_4"
    for step in (2, 3, 4):
        Checkpointer(run_dir, keep_last=0).verify(checkpoints / f"step_{step}")
    straight, straight_dir = run(tmp_path, "straight", *SAVED_EVERY_STEP)

    # step 1's batch was made before any update, each later one while the step before it trained; step 2's is
    # the one step_1 holds, and the resume trains on it as the uninterrupted run does
    assert [r["staleness/max"] for r in records[1:]] == [0, 1, 1, 1]
    assert records[2]["staleness/share_lag_1"] == records[3]["staleness/share_lag_1"] == 1.0
    assert math.isfinite(records[2]["rollout/logprob_diff_mean_lag_1"])
    assert [learning_metrics(r) for r in records] == [learning_metrics(r) for r in straight]
    expected, got = weights(straight_dir, 4), weights(run_dir, 4)
    assert set(got) == set(expected) and all(got[name].equal(expected[name]) for name in got)
    # the prompts of each step are the stream's next four, in order: none repeated or skipped by the resume
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    cfg = load_config("base", SMALL)
    stream = build_loader(cfg.data, build_char_tokenizer(), "train")
    for step in range(1, 5):
        expected = [draw.row.row_id for draw in stream.next_batch() for _ in range(4)]  # rollout.n=4
        assert [s["row_id"] for s in samples if s["step"] == step] == expected


def test_a_resume_at_another_staleness_bound_regenerates_the_saved_batches(tmp_path, monkeypatch, caplog):
    lines, records, _ = interrupted_at_the_first_save(tmp_path, monkeypatch, caplog, "changed",
                                                      "trainer.asynchronous.max_staleness=0")
    assert lines == ["dropping the checkpoint's 1 batch(es) made ahead, made under other settings "
                     "(trainer.asynchronous.max_staleness): regenerating them under the restored weights"]
    assert [r["staleness/max"] for r in records[1:]] == [0, 1, 0, 0]  # step 3's batch made again, on the weights


def test_partial_rollouts_park_at_the_refit_and_resume_under_the_new_weights(tmp_path, monkeypatch):
    """Each batch after the first waits at its third decode step for the trainer's refit (so the park does
    not depend on timing): its first three tokens are sampled one version behind, the other five under
    the weights it trains at. The third batch is parked by the refit of the evaluation after step 2,
    which runs while it waits."""
    generate, calls = ResumableEngine.generate, []

    def parked_at_the_third_token(engine, prompts, params):
        ahead = engine.await_refit.__self__  # the GenerateAhead whose refit parks the call
        polls, first = itertools.count(1), not calls
        calls.append(len(prompts))

        def refit_wanted():
            poll = next(polls)
            if first or poll > 3:  # the first batch is made before any update: no refit comes
                return ahead._refit_wanted
            if poll == 3:
                with ahead._changed:
                    ahead._changed.wait_for(lambda: ahead._refit_wanted, timeout=60)  # only a broken park waits
            return poll == 3  # a refit wanted earlier (the trainer was quicker) waits for the third token

        engine.refit_wanted = refit_wanted
        return generate(engine, prompts, params)

    monkeypatch.setattr(ResumableEngine, "generate", parked_at_the_third_token)
    records, _ = run(tmp_path, "partial", *AHEAD, "trainer.asynchronous.partial_rollouts=true",
                     "trainer.asynchronous.max_staleness=1", "trainer.total_steps=3", "trainer.eval.every=2",
                     "rollout.ignore_eos=true")  # every response runs to its 8 tokens
    steps = [r for r in records if "async/parked_share" in r]
    assert len(calls) == 3 and len(steps) == 3 and "val/accuracy" in records[2]
    assert [r["async/parked_share"] for r in steps] == [0.0, 1.0, 1.0]
    assert steps[2]["async/refit_s"] == 0  # the evaluation's refit had parked the third batch
    assert [r["staleness/max"] for r in steps] == [0, 1, 1]
    assert [r.get("staleness/share_lag_1", 0.0) for r in steps] == [0.0, 3 / 8, 3 / 8]
    assert all(math.isfinite(r["rollout/logprob_diff_mean_lag_1"]) for r in steps[1:])
    assert all(r["actor/grad_norm"] > 0 for r in steps)


def test_dynamic_sampling_refills_park_in_a_call_and_between_two_calls(tmp_path, monkeypatch):
    """Dynamic sampling with partial rollouts at k = 1, groups dropped by rule (e2e_rewards.thirds_agree:
    the rows numbered a multiple of 3). The stream's rows 16 36 27 8 | 44 23 | 53 4 58 50 | 10 2 42 34 | 19
    make step 1 two engine calls (36 and 27 dropped), step 2 one, step 3 two (42 dropped). Step 2's call
    parks at its third token; step 3's first call runs whole on version 1 and the refit, wanted after it,
    parks the second at its first token (the hf engine polls after each). The filter judges every response
    whole: 8 tokens, resumed."""
    generate, calls, judged = ResumableEngine.generate, [], []
    filter_groups = DynamicSampling._filter

    def parked_by_rule(engine, prompts, params):
        ahead = engine.await_refit.__self__
        polls, call = itertools.count(1), len(calls)
        calls.append(len(prompts) // 4)  # groups of rollout.n=4
        park_at = {2: 3, 4: 1}.get(call)  # step 2's call, step 3's second call

        def refit_wanted():
            poll = next(polls)
            if call == 3 or (park_at and poll < park_at):
                return False  # the refit waits (for the end of step 3's first call)
            if poll == park_at:
                with ahead._changed:
                    ahead._changed.wait_for(lambda: ahead._refit_wanted, timeout=60)  # only a broken park waits
                return True
            return ahead._refit_wanted

        engine.refit_wanted = refit_wanted
        return generate(engine, prompts, params)

    def recorded(sampling, batch, stats):
        rows = zip(batch.generation_versions, batch.sampled)
        judged.append([versions[sampled].tolist() for versions, sampled in rows])
        return filter_groups(sampling, batch, stats)

    monkeypatch.setattr(ResumableEngine, "generate", parked_by_rule)
    monkeypatch.setattr(DynamicSampling, "_filter", recorded)
    records, _ = run(tmp_path, "refills", *AHEAD, "trainer.asynchronous.partial_rollouts=true",
                     "trainer.asynchronous.max_staleness=1", "trainer.total_steps=3", "rollout.ignore_eos=true",
                     "dynamic_sampling.enabled=true", "dynamic_sampling.filter_metric=seq_reward",
                     "reward.sources.arithmetic=e2e_rewards.thirds_agree")
    steps = records[1:]
    assert calls == [4, 2, 4, 4, 1]
    old, parked, new, between = [0] * 8, [0] * 3 + [1] * 5, [1] * 8, [1] + [2] * 7
    assert judged == [[old] * 16, [old] * 8, [parked] * 16, [new] * 16, [between] * 4]
    assert [r["dynamic_sampling/num_gen_batches"] for r in steps] == [2, 1, 2]
    assert [r["dynamic_sampling/filtered_fraction"] for r in steps] == [2 / 6, 0.0, 1 / 5]
    assert [r["async/parked_share"] for r in steps] == [0.0, 1.0, 1 / 4]
    # step 3 trains at version 2: its three groups of version 1 one behind, the resumed one's first token too
    assert [r.get("staleness/share_lag_1", 0.0) for r in steps] == [0.0, 3 / 8, (12 * 8 + 4) / (16 * 8)]
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    # the behaviour log-prob of each token is its version's: those resumed under the weights trained at match
    # the trainer's up to numerics (float32, 1e-7 here), those one version behind differ by the update
    assert all(r["rollout/logprob_diff_mean_lag_0"] < 1e-5 for r in steps)
    assert all(r["rollout/logprob_diff_mean_lag_1"] > 1e-2 for r in steps[1:])
    assert_every_value_a_number(records)


MTPO = ["+variant=mtpo", "mtpo.answer_stop_str='>'", "mtpo.confidence_stop_str='<'", "mtpo.max_answer_length=8",
        "mtpo.max_confidence_length=8", "mtpo.num_confidence_generations=2",  # G x H = rollout.n = 4
        "+reward.sources.short_qa=e2e_rewards.character_parity"]  # answers of the tiny model differ: it learns


def test_mtpo_rounds_park_at_the_refit_each_token_keeping_its_version(tmp_path, monkeypatch):
    """MTPO's two rounds with partial rollouts at k = 1 (one-character stop strings, which the tiny model
    meets): round 1 of each batch after the first waits at its third decode step for the trainer's refit.
    Its first three tokens (fewer where the answer ended sooner) keep the version before, the rest of the
    answer and every round-2 token (sampled after the park) carry the next; the engine's log-prob of each
    token is that of its version's weights."""
    generate, round_1_calls, assembled = ResumableEngine.generate, [], []
    assemble_samples = TwoRoundSampling.assemble_samples

    def round_1_parked_at_the_third_token(engine, prompts, params):
        ahead, polls = engine.await_refit.__self__, itertools.count(1)
        round_1 = params.stop == [">"] and threading.current_thread().name == "generate-ahead"  # not evaluating
        first = round_1 and not round_1_calls  # the first batch is made before any update: no refit comes
        round_1_calls.extend([len(prompts)] if round_1 else [])

        def refit_wanted():
            if not round_1 or first or next(polls) != 3:
                return ahead._refit_wanted
            with ahead._changed:
                ahead._changed.wait_for(lambda: ahead._refit_wanted, timeout=60)  # only a broken park waits
            return True

        engine.refit_wanted = refit_wanted
        return generate(engine, prompts, params)

    def recorded(maker, samples, scored):
        batch = assemble_samples(maker, samples, scored)
        assembled.append(batch)
        return batch

    monkeypatch.setattr(ResumableEngine, "generate", round_1_parked_at_the_third_token)
    monkeypatch.setattr(TwoRoundSampling, "assemble_samples", recorded)
    cfg = load_config("base", SMALL_MODEL + MTPO + [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=mtpo", "trainer.export_hf=false",
        "trainer.tensorboard=false", "policy.optim.lr=1e-3", "rollout.ignore_eos=true", "trainer.total_steps=3",
        "trainer.seed=1",  # its first step updates (seed 0's groups all agree: no update for lag 1 to show)
        *AHEAD, "trainer.asynchronous.partial_rollouts=true", "trainer.asynchronous.max_staleness=1"])
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "mtpo" / "metrics.jsonl").read_text().splitlines()]
    assert round_1_calls == [8, 8, 8] and len(assembled) == 3  # 4 prompts x G = 2 answers a batch
    for new, batch in enumerate(assembled):  # batch k (from 0) ends on version k; after the first, parked once
        old = max(new - 1, 0)
        answers = (batch.segment_ids == 0) & batch.sampled
        for versions, answer, sampled in zip(batch.generation_versions, answers, batch.sampled):
            length = int(answer.sum())
            expected = [old] * min(3, length) + [new] * (int(sampled.sum()) - min(3, length))
            assert versions[sampled].tolist() == expected
        assert (batch.segment_ids[batch.sampled] == 1).any()  # round 2 ran
    steps = records[1:]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1]
    assert all(r["rollout/logprob_diff_mean_lag_0"] < 1e-5 for r in steps)
    assert all(r["rollout/logprob_diff_mean_lag_1"] > 1e-2 for r in steps[1:])
    assert [r["async/parked_share"] for r in steps] == [0.0, 1.0, 1.0]


def test_a_step_whose_groups_were_all_dropped_logs_no_parked_share(tmp_path):
    """Every group dropped (every sample wrong) after two refills: the steps train on no response, and the
    share of parked responses among none is left out, not NaN."""
    records, _ = run(tmp_path, "dropped", *AHEAD, "trainer.asynchronous.partial_rollouts=true",
                     "trainer.total_steps=2", "trainer.no_learning_steps=3", "dynamic_sampling.enabled=true",
                     "dynamic_sampling.max_gen_batches=2", "reward.sources.arithmetic=e2e_rewards.always_wrong")
    steps = records[1:]
    assert [r["dynamic_sampling/filtered_fraction"] for r in steps] == [1.0, 1.0]
    assert not any("async/parked_share" in r or "actor/grad_norm" in r for r in steps)
    assert_every_value_a_number(records)


def assert_every_value_a_number(records):
    """No metric NaN or infinite (metrics.jsonl writes one as null)."""
    assert all(isinstance(value, (int, float)) and math.isfinite(value) for r in records for value in r.values())


def test_a_resume_may_turn_generation_ahead_off_or_on(tmp_path, monkeypatch, caplog):
    """The maker's state is wrapped by generation ahead: a resume that switches it unwraps or wraps it."""
    lines, records, _ = interrupted_at_the_first_save(tmp_path, monkeypatch, caplog, "off", then=SAVED_AT_2_OF_4)
    assert lines == ["the checkpoint was saved generating ahead of training: its 1 batch(es) made ahead are "
                     "regenerated by this synchronous run"]
    assert [r["staleness/max"] for r in records[1:]] == [0, 1, 0, 0]
    lines, records, _ = interrupted_at_the_first_save(tmp_path, monkeypatch, caplog, "on", first=SAVED_AT_2_OF_4)
    assert lines == ["the checkpoint holds no batches made ahead (saved by a synchronous run, or before checkpoints "
                     "held them): the batches that were in flight are regenerated under the restored weights"]
    assert [r["staleness/max"] for r in records[1:]] == [0, 0, 0, 1]
