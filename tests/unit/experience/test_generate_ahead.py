"""GenerateAhead's admission and hand-over with fake parts (no model): the batch of each step is sampled at
most max_staleness versions behind the version it trains at, generation overlaps training when the bound
allows it, the trainer's prompt stream moves as the synchronous run's, an error in the thread reaches
the trainer, and with partial rollouts a refit parks the batch in progress rather than wait for it, and a save
holds a parked batch.
Waits are on events, never on the clock."""

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from aligner_ext.experience.ahead import GenerateAhead, GenerationStream
from aligner_ext.experience.base import ExperienceMaker
from aligner_ext.experience.settings import AsynchronousConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.resumable import ResumableEngine

TIMEOUT_S = 60  # only a broken implementation waits this long


class Stream:
    """A prompt loader reduced to its position."""

    def __init__(self):
        self.draws = 0

    def state_dict(self):
        return {"draws": self.draws}

    def load_state_dict(self, state):
        self.draws = state["draws"]


class Recording(ExperienceMaker):
    """Draws 4 prompts per step and records the version of the weights each step was sampled with."""

    def __init__(self, engine, fail_at=None):
        self.engine, self.fail_at = engine, fail_at
        self.sampled_at: dict[int, int] = {}
        self.started = {step: threading.Event() for step in range(10)}
        self.hold_at: dict[int, threading.Event] = {}  # a step's batch ends only once its event is set

    def make_experience(self, loader, step):
        self.started[step].set()
        if step in self.hold_at:
            assert self.hold_at[step].wait(TIMEOUT_S)
        if step == self.fail_at:
            raise RuntimeError(f"step {step} failed")
        loader.draws += 4
        self.sampled_at[step] = self.engine.weights_version
        return f"batch {step}", {"made": float(step)}

    def state_dict(self):
        return {"made": sorted(self.sampled_at)}

    def load_state_dict(self, state):
        self.sampled_at = dict.fromkeys(state["made"])


def ahead_of(max_staleness, steps=6, updates_per_step=1, fail_at=None):
    engine = SimpleNamespace(weights_version=0)
    policy = SimpleNamespace(version=0)
    snapshot = SimpleNamespace(refits=0, stream=GenerationStream(torch.device("cpu")))
    snapshot.refit = lambda: setattr(snapshot, "refits", snapshot.refits + 1)
    inner = Recording(engine, fail_at)
    ahead = GenerateAhead(inner, AsynchronousConfig(enabled=True, max_staleness=max_staleness), snapshot, engine,
                          policy, total_steps=steps, updates_per_step=updates_per_step, settings={})
    return ahead, inner, policy


def train(ahead, inner, policy, steps=6, updates_per_step=1, during_update=lambda step: None):
    """The loop's side: take each step's batch, then make the step's updates."""
    stream, trained_at = Stream(), {}
    for step in range(steps):
        batch, metrics = ahead.make_experience(stream, step)
        assert batch == f"batch {step}" and metrics["made"] == step
        assert stream.draws == 4 * (step + 1)  # where the synchronous run's stream stands after this step
        trained_at[step] = policy.version
        during_update(step)
        policy.version += updates_per_step
    return trained_at


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_no_batch_trains_more_than_max_staleness_versions_behind(max_staleness):
    ahead, inner, policy = ahead_of(max_staleness)
    trained_at = train(ahead, inner, policy)
    lags = [trained_at[step] - inner.sampled_at[step] for step in range(6)]
    assert all(0 <= lag <= max_staleness for lag in lags), lags
    if max_staleness == 0:
        assert lags == [0] * 6


def test_with_a_bound_of_one_the_next_batch_is_made_while_the_policy_updates():
    ahead, inner, policy = ahead_of(1)

    def update(step):  # the update of step s waits until step s + 1's batch has started
        if step < 5:
            assert inner.started[step + 1].wait(TIMEOUT_S)

    trained_at = train(ahead, inner, policy, during_update=update)
    # each batch after the first was sampled while the previous update ran: one version behind
    assert [trained_at[step] - inner.sampled_at[step] for step in range(6)] == [0, 1, 1, 1, 1, 1]


def test_two_updates_a_step_and_a_bound_of_two():
    ahead, inner, policy = ahead_of(2, updates_per_step=2)

    def update(step):
        if step < 5:
            assert inner.started[step + 1].wait(TIMEOUT_S)

    trained_at = train(ahead, inner, policy, updates_per_step=2, during_update=update)
    assert [trained_at[step] - inner.sampled_at[step] for step in range(6)] == [0, 2, 2, 2, 2, 2]


def saved_with_two_batches_ahead(settings):
    """A checkpoint's maker state after step 0, k = 2: steps 1 and 2 made ahead (the save waits for step 2's,
    held until the save asks)."""
    ahead, inner, policy = ahead_of(2)
    ahead.settings = settings
    saving, settled = threading.Event(), ahead._settled
    ahead._settled = lambda: saving.set() or settled()
    inner.hold_at[2] = saving
    ahead.make_experience(Stream(), 0)
    assert inner.started[2].wait(TIMEOUT_S)
    return ahead.state_dict()


def test_a_save_waits_for_the_batch_in_progress_and_holds_every_batch_not_taken():
    state = saved_with_two_batches_ahead({"rollout.n": 4})
    assert state["inner"] == {"made": [0]}  # the maker after the batch the trainer took
    assert [(made["step"], made["batch"], made["metrics"], made["loader_state"], made["maker_state"])
            for made in state["ready"]] == [(1, "batch 1", {"made": 1.0}, {"draws": 8}, {"made": [0, 1]}),
                                            (2, "batch 2", {"made": 2.0}, {"draws": 12}, {"made": [0, 1, 2]})]
    assert state["settings"] == {"rollout.n": 4}


def resumed_from(state, settings):
    """A fresh wrapper (k = 2) given `state` as a resume would, its trainer's loader where step 0 left it."""
    ahead, inner, policy = ahead_of(2)
    ahead.settings = settings
    ahead.load_state_dict(state)
    stream = Stream()
    stream.load_state_dict({"draws": 4})
    return ahead, inner, policy, stream


def test_a_resume_takes_the_saved_batches_first_then_makes_the_next_from_the_last_ones_position():
    ahead, inner, policy, stream = resumed_from(saved_with_two_batches_ahead({"rollout.n": 4}), {"rollout.n": 4})
    for step in (1, 2, 3):
        assert ahead.make_experience(stream, step)[0] == f"batch {step}"
        assert stream.draws == 4 * (step + 1)
        policy.version += 1
    assert not inner.started[1].is_set() and not inner.started[2].is_set()  # restored, not made again
    assert ahead.taken_state == {"made": [0, 1, 2, 3]}  # step 3 made from step 2's maker state


def test_a_resume_under_other_settings_or_from_an_older_checkpoint_regenerates_the_batches(caplog):
    caplog.set_level(logging.INFO, logger="aligner_ext.experience.ahead")
    saved = saved_with_two_batches_ahead({"rollout.n": 4})
    older = {"inner": saved["inner"]}
    for state, settings, line in ((saved, {"rollout.n": 8}, "dropping the checkpoint's 2 batch(es) made ahead, "
                                   "made under other settings (rollout.n)"),
                                  (older, {"rollout.n": 4}, "the checkpoint holds no batches made ahead")):
        caplog.clear()
        ahead, inner, policy, stream = resumed_from(state, settings)
        assert [line in record.getMessage() for record in caplog.records] == [True]  # one line, this one
        assert ahead.make_experience(stream, 1)[0] == "batch 1" and inner.started[1].is_set()
        assert stream.draws == 8 and ahead.taken_state == {"made": [0, 1]}


def test_an_error_in_the_thread_is_raised_in_the_trainer():
    ahead, inner, policy = ahead_of(1, fail_at=2)
    stream = Stream()
    for step in range(2):
        ahead.make_experience(stream, step)
        policy.version += 1
    with pytest.raises(RuntimeError, match="^step 2 failed$"):
        ahead.make_experience(stream, 2)


def test_a_step_past_the_run_is_refused_rather_than_awaited():
    ahead, inner, policy = ahead_of(0, steps=2)
    with pytest.raises(ValueError, match="^step 2: generation ahead makes batches for trainer.total_steps=2 steps"):
        ahead.make_experience(Stream(), 2)


def test_a_batch_waits_for_the_newest_weights_even_within_the_bound():
    ahead, inner, policy = ahead_of(3)
    assert ahead._admitted(2)  # the copy and the policy at version 0; step 2 trains at version 2 at most
    assert not ahead._admitted(4)  # 4 versions behind: past the bound
    policy.version = 1  # an update ended, the trainer has not refitted the copy yet
    assert not ahead._admitted(2)


def test_evaluation_samples_the_current_weights_between_two_batches():
    """A maker that evaluates its own way (MTPO's two rounds) samples from the copy: it is refitted first."""
    ahead, inner, policy = ahead_of(1)
    seen = []
    inner.evaluate = lambda loader, single_round: (seen.append((ahead.engine.weights_version, ahead._generating))
                                                   or {"val/accuracy": 1.0})
    stream = Stream()
    ahead.make_experience(stream, 0)
    policy.version += 1  # step 0's update; step 1's batch may be in progress on version 0
    assert ahead.evaluate(stream, None) == {"val/accuracy": 1.0}
    # on version 1, no batch in progress; refitted at the first request, then before the evaluation
    assert seen == [(1, False)] and ahead.weights.refits == 2


class Decoding(GenerationEngine):
    """One token per decode step, `should_stop` polled after each; `after_token(prompt, count)` runs
    after each token (the test holds a call there)."""

    def __init__(self):
        self.after_token = lambda prompt, count: None

    def generate(self, prompts, params, should_stop):
        tokens = []
        while len(tokens) < params.max_new_tokens:
            tokens.append(7)
            self.after_token(prompts[0], len(tokens))
            if should_stop():
                break
        return [GenerationOutput(token_ids=tokens, finish_reason="length")]


class Responses(SimpleNamespace):
    """The fields of a batch partial rollouts read, and its length."""

    def __len__(self):
        return len(self.sampled)


class Sampling(ExperienceMaker):
    """One 4-token response per step (prompt [step]): a batch of the fields partial rollouts read; with
    `keep=False` the response is dropped (as dynamic sampling drops a group), leaving a batch of none."""

    def __init__(self, engine, keep=True):
        self.engine, self.keep = engine, keep
        self.made = {step: threading.Event() for step in range(10)}

    def make_experience(self, loader, step):
        loader.draws += 4
        output, = self.engine.generate([[step]], SamplingParams(max_new_tokens=4))
        self.made[step].set()
        rows = 1 if self.keep else 0
        return Responses(generation_versions=torch.tensor([output.versions] * rows).view(rows, 4),
                         sampled=torch.ones(rows, 4, dtype=torch.bool)), {}

    def state_dict(self):
        return {}


def parking_step_2():
    """k = 2 with partial rollouts, three steps: step 2's batch (two ahead) waits after its first token for a refit,
    and `holding` is set when it does. Returns the wrapper, its maker, the policy and `holding`."""
    inner = Decoding()
    engine = ResumableEngine(inner, tokenizer=None)  # no stop strings to decode
    policy = SimpleNamespace(version=0)
    snapshot = SimpleNamespace(refit=lambda: None, stream=GenerationStream(torch.device("cpu")))
    maker = Sampling(engine)
    ahead = GenerateAhead(maker, AsynchronousConfig(enabled=True, max_staleness=2, partial_rollouts=True), snapshot,
                          engine, policy, total_steps=3, updates_per_step=1, settings={})
    holding = threading.Event()

    def hold_step_2(prompt, count):
        if prompt == [2] and count == 1:
            holding.set()
            with ahead._changed:
                assert ahead._changed.wait_for(lambda: ahead._refit_wanted, timeout=TIMEOUT_S)

    inner.after_token = hold_step_2
    return ahead, maker, policy, holding


def test_with_partial_rollouts_a_refit_parks_the_batch_in_progress_and_it_resumes_under_the_new_version():
    ahead, maker, policy, holding = parking_step_2()
    stream, taken = Stream(), []
    for step in range(3):
        batch, metrics = ahead.make_experience(stream, step)
        taken.append((batch.generation_versions.tolist()[0], metrics["async/parked_share"]))
        if step == 0:  # steps 1 and 2's batches start on version 0, step 2's holds
            assert holding.wait(TIMEOUT_S)
        if step == 1:  # step 2's batch ends (resumed) before this update: it parks once only
            assert maker.made[2].wait(TIMEOUT_S)
        policy.version += 1
    # step 1's batch was ready at the first refit, taken while step 2's was parked after its first token
    assert taken == [([0, 0, 0, 0], 0.0), ([0, 0, 0, 0], 0.0), ([0, 1, 1, 1], 1.0)]


def test_with_partial_rollouts_a_batch_of_no_response_leaves_the_parked_share_out():
    """A share of no responses is undefined (NaN): left out, as the staleness metrics of no token are."""
    engine = ResumableEngine(Decoding(), tokenizer=None)
    snapshot = SimpleNamespace(refit=lambda: None, stream=GenerationStream(torch.device("cpu")))
    ahead = GenerateAhead(Sampling(engine, keep=False), AsynchronousConfig(enabled=True, partial_rollouts=True),
                          snapshot, engine, SimpleNamespace(version=0), total_steps=1, updates_per_step=1,
                          settings={})
    batch, metrics = ahead.make_experience(Stream(), 0)
    assert len(batch) == 0 and "async/parked_share" not in metrics and "async/refit_s" in metrics


def test_a_save_holds_a_parked_batch_that_has_not_resumed_yet():
    """k = 2, partial rollouts: step 2's batch parks at the refit of step 1's request and the trainer takes step 1's
    batch, ready. The test keeps the lock past the update, so the parked call cannot resume before the save asks
    (as a thread slow to wake would): the save still waits for it and holds it, its first token one version behind."""
    ahead, maker, policy, holding = parking_step_2()
    stream = Stream()
    ahead.make_experience(stream, 0)
    assert holding.wait(TIMEOUT_S) and maker.made[1].is_set()
    policy.version += 1
    with ahead._changed:  # re-entrant: held across the request, the update and the save
        ahead.make_experience(stream, 1)
        policy.version += 1
        state = ahead.state_dict()
    assert [(made["step"], made["batch"].generation_versions.tolist()) for made in state["ready"]] == [
        (2, [[0, 1, 1, 1]])]


def test_the_next_batch_has_started_when_the_trainer_gets_its_batch():
    """No hold in the update: the trainer, handed step s's batch, returns only once step s + 1's has started, so
    it samples the weights before the update however the threads are scheduled (before, a trainer that updated
    before the thread woke had it wait for the refit and sample the new weights: lag 0 instead of 1)."""
    ahead, inner, policy = ahead_of(1)
    trained_at = train(ahead, inner, policy)
    assert [trained_at[step] - inner.sampled_at[step] for step in range(6)] == [0, 1, 1, 1, 1, 1]


def test_the_copy_shares_the_frozen_weights_and_refits_the_trainable_ones():
    """LoRA's case: the base frozen, the adapter trained. The copy holds the frozen tensor itself (training never
    changes it; a copy at another address gave other last bits on the CPU) and its own trainable one, which a
    refit brings to the live value."""
    from aligner_ext.experience.ahead import WeightsSnapshot

    live = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    live[0].requires_grad_(False)
    snapshot = WeightsSnapshot(live)
    assert snapshot.model[0].weight is live[0].weight and snapshot.model[0].bias is live[0].bias
    assert snapshot.model[1].weight is not live[1].weight and snapshot.model[1].weight.requires_grad
    with torch.no_grad():
        live[1].weight.add_(1.0)
    before = snapshot.model[1].weight.detach().clone()
    torch.testing.assert_close(before + 1.0, live[1].weight.detach(), rtol=0, atol=0)  # not refitted yet: its own
    snapshot.refit()
    assert torch.equal(snapshot.model[1].weight, live[1].weight)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda:1", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="a second GPU"))])
def test_a_copy_on_a_device_of_its_own_holds_every_weight_there(device):
    """`trainer.asynchronous.device`: the copy's parameters and buffers are made on that device, none shared with
    the live model (frozen ones included), tied weights stay tied, and requires_grad is the live model's. With
    two GPUs, from the first: the values are the live ones, and a refit copies the trained ones across."""
    from aligner_ext.experience.ahead import WeightsSnapshot

    home = "cuda:0" if device.startswith("cuda") else "cpu"
    live = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5, bias=False))
    live[2].weight = live[0].weight
    live[1].requires_grad_(False)
    live[1].register_buffer("scale", torch.arange(4.0))
    live.to(home)
    snapshot = WeightsSnapshot(live, torch.device(device))
    copied = dict(snapshot.model.named_parameters()) | dict(snapshot.model.named_buffers())
    originals = dict(live.named_parameters()) | dict(live.named_buffers())
    assert copied.keys() == originals.keys()
    for name, tensor in copied.items():
        assert tensor.device == torch.device(device) and tensor is not originals[name], name
        assert tensor.requires_grad == originals[name].requires_grad, name
    assert snapshot.model[2].weight is snapshot.model[0].weight
    assert all(tensor.device == torch.device(home) for tensor in originals.values())
    if device == "meta":
        return
    for name, tensor in copied.items():
        assert torch.equal(tensor.cpu(), originals[name].cpu()), name
    with torch.no_grad():
        live[0].weight.add_(1.0)
    snapshot.refit()
    torch.cuda.synchronize(device)
    assert torch.equal(snapshot.model[0].weight.cpu(), live[0].weight.cpu())
    assert torch.equal(snapshot.model[2].weight.cpu(), live[0].weight.cpu())


def test_a_compiled_function_entered_while_the_other_thread_traces_runs_rather_than_raising():
    """torch's FX-tracing flag is one per process: while the trainer's thread traces (every compilation does), the
    generation thread's compiled calls raised in torch's default. Generation ahead sets them to run the function
    (its result unchanged); the trace is held open by an event, not by time."""
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    inside, release = threading.Event(), threading.Event()

    def traced(x):
        inside.set()
        assert release.wait(TIMEOUT_S)
        return x + 1

    def call_while_traced() -> torch.Tensor:
        tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,))
        tracer.start()
        try:
            assert inside.wait(TIMEOUT_S)
            return compiled(torch.ones(3))
        finally:
            release.set()
            tracer.join()
            inside.clear()
            release.clear()

    with torch._dynamo.config.patch(error_on_nested_fx_trace=True):  # torch's default; the value before, after
        with pytest.raises(RuntimeError, match="Detected that you are using FX to symbolically trace"):
            call_while_traced()
        ahead, inner, policy = ahead_of(max_staleness=1, steps=2)
        train(ahead, inner, policy, steps=2)  # starts the thread
        assert torch.equal(call_while_traced(), torch.full((3,), 3.0))
