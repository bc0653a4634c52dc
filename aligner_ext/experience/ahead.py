"""Generation ahead of training (asynchronous training): while the policy trains on step t's batch, a
thread of the trainer's process generates the next steps' batches (docs/async.md).

How (trainer.asynchronous; the loop is unchanged, it asks this wrapper for each step's batch):
- Weights, by placement (`GenerationWeights`). The thread runs the configured experience maker (wrappers
  and rewards included) with an engine of its own. Colocated (hf, rollout): the engine samples from
  `WeightsSnapshot`, a copy of the generation model on the trainer's device, or on a GPU of its own in the
  trainer's process (`device`: the copy and the engine's cache leave the trainer's GPU). Disaggregated (remote):
  the engine drives generation servers, which hold the weights (`ServedWeights`: no copy here). The
  trainer refits those weights to the policy's (a copy in place, or a push to the servers carrying the
  version), at a version boundary, when it asks for a batch or evaluates, and only between two batches
  (a refit waits for the batch in progress), so a batch is sampled under one version, stamped on its
  tokens (`GenerationEngine.weights_version`; a server reports the version it sampled under and the
  remote engine checks it, generation/remote.py).
- Partial rollouts (`partial_rollouts`). A refit does not wait for the batch in progress: its engine
  call parks the unfinished responses, the copy is refitted, and they resume under the new weights,
  re-prefilled (generation/resumable.py); their tokens keep the version that sampled them, so a
  response's versions may vary. Every built-in maker that generates ahead parks so (group sampling, the
  graded system prompt, MTPO's two rounds; a maker of user code is refused, experience/settings.py). A
  batch made over several engine calls (dynamic sampling's refills, MTPO's two rounds) parks in the call
  in progress, or, wanted between two calls, at the next call's first decode step; the maker sees each
  call's responses whole, once resumed (MTPO's round 2 continues round 1's answers whole). Admission is
  unchanged: a batch's oldest tokens are those of the version it started on, which admission bounds, so
  parking never ages a token past k.
- Admission. The batch of step t starts only once the engine's weights' version v satisfies V(t) - v <= k, with
  k = `trainer.asynchronous.max_staleness` and V(t) the version step t trains at, bounded by the
  trainer's version at its latest request plus `updates_per_step` for each step in between (a step
  makes no more updates; a skipped one makes fewer). So no token reaches training more than k versions
  behind the proximal policy, and none can age past the bound: there is nothing to drop or wait for
  at training time. With k = 0 each batch waits for the previous update: the synchronous run, bit for
  bit (tests/e2e/test_async_runs.py). A batch also starts on the newest weights: once the policy has
  moved past the engine's weights, the thread waits for the trainer's refit rather than sample from the
  old ones. And the trainer, handed a batch, goes on only once the thread has started the next one where
  admission allows it (a thread switch): that batch samples the weights the step is about to update
  whatever the threads' scheduling, so a run's versions, and its numbers, do not depend on the machine's load.
- The prompt stream. The thread draws from its own view of the loader; when the trainer takes step t's
  batch, its loader and this wrapper's maker state are set to where they stood after that batch was
  made. A checkpoint thus saves the synchronous run's position, and beside it every batch made and not yet
  taken (`state_dict`): the save first lets the thread make every batch admission allows (the one in
  progress, parked or not: one parked at the latest refit counts as in progress until it ends, resumed,
  since no refit is wanted while the trainer saves; the trainer changes nothing admission reads meanwhile).
  A resume trains on those first, their tokens' versions and behaviour log-probs those they were
  sampled with, and the thread goes on from the last one's loader and maker state: the uninterrupted run,
  and no prompt repeated or skipped. Batches saved under other settings (`batch_settings`) are dropped and
  regenerated under the restored weights, as are those of a checkpoint that holds none.
- Failures. An error in the thread is raised again in the trainer at its next request.
- The device. On a GPU the thread queues its work on a CUDA stream of its own (`GenerationStream`), so
  that its kernels run beside training's rather than behind them in one queue; the refit and the
  evaluation are ordered with it both ways. A batch is handed over in host memory (the engines return
  host lists), so the hand-over needs no device synchronisation.

Metrics per step: async/trainer_wait_s (the trainer waiting for the refit and the batch),
async/generator_idle_s (the thread waiting for admission since the previous step), async/refit_s,
async/batches_ready (made and not yet taken), async/parked_share (with partial rollouts: the share of the
batch's responses sampled under more than one version; left out of a batch of no response, as the staleness
metrics of no token are); the tokens' staleness per lag comes from the loop
(trainer/step_metrics.py).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.data.loader import PromptLoader
from aligner_ext.experience.base import ExperienceMaker, ExperienceWrapper
from aligner_ext.experience.settings import AsynchronousConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams

if TYPE_CHECKING:
    from aligner_ext.models.base import Policy

logger = logging.getLogger(__name__)

# Settings that cannot change a batch once made: a checkpoint's batches made ahead are kept when all others
# match (`batch_settings`); the exceptions within them change which batches admission allows.
BOOKKEEPING = ("trainer.", "policy.optim.", "serve.")
SHAPING_AMONG_BOOKKEEPING = ("trainer.seed", "trainer.asynchronous.max_staleness")


def batch_settings(flat_settings: dict[str, object]) -> dict[str, object]:
    """Of the run's settings (flattened keys), those a batch made ahead depends on: what the maker, the
    engines, the rewards and the data read, the policy's model, and the staleness bound it was admitted under.
    Conservative: a batch dropped needlessly costs its regeneration; one kept wrongly would train unseen."""
    return {key: value for key, value in flat_settings.items()
            if not key.startswith(BOOKKEEPING) or key.startswith(SHAPING_AMONG_BOOKKEEPING)}


def run_compiled_calls_beside_tracing() -> None:
    """A compiled function entered while the other thread traces runs eagerly that once rather than raising.
    torch's flag for FX tracing is one per process (torch.fx._symbolic_trace), and AOTAutograd traces with it
    set at every compilation: while the trainer compiles (a new packed width), the generation thread's compiled
    decode step or sampler would raise "Detected that you are using FX to symbolically trace a dynamo-optimized
    function" (seen once on an H200, docs/benchmarks.md), and symmetrically. Dynamo's own setting makes such a
    call run the original function, whose result is the same; only a real nested trace, which would raise, is
    changed."""
    torch._dynamo.config.error_on_nested_fx_trace = False


class GenerationStream:
    """The generation thread's own CUDA stream (none on the CPU): its kernels then run beside training's,
    where one stream would queue each behind the other."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def enter(self) -> None:
        """In the generation thread: its CUDA work goes to this stream, and to its device (a GPU of its own,
        `trainer.asynchronous.device`), from now on."""
        if self.stream is not None:
            torch.cuda.set_device(self.stream.device)
            torch.cuda.set_stream(self.stream)

    @contextmanager
    def joined(self):
        """In the trainer's thread: the block's work runs after all the generation thread queued (the
        copy it samples from is not rewritten under it), and the thread's later work after the block's
        (it samples from the refitted copy)."""
        if self.stream is None:
            yield
            return
        trainer = torch.cuda.current_stream(self.stream.device)
        trainer.wait_stream(self.stream)
        try:
            yield
        finally:
            self.stream.wait_stream(trainer)


class GenerationWeights(Protocol):
    """Where the generation thread's engine reads its weights, by placement: a copy in the trainer's process
    (colocated, `WeightsSnapshot`) or generation servers (disaggregated, `ServedWeights`)."""

    stream: GenerationStream  # the generation thread's device work, ordered with the refit and the evaluation

    def refit(self) -> None:
        """Give the engine's weights the live policy's, between two batches (the engine's version already set)."""


class WeightsSnapshot:
    """Colocated: a copy of the generation model `live` that a second engine samples from, refitted in
    place, and the stream the generation thread samples from it on. On the live model's device the copy
    holds its own trainable weights and shares the frozen ones (LoRA's base), which training never changes:
    it then costs the adapters alone, and its kernels read the very tensors the live model's do (on the CPU,
    frozen weights copied to other addresses gave log-probs that differ from the live model's in the last
    bits). On a `device` of its own (`trainer.asynchronous.device`, a second GPU) it holds all its weights
    there, and a refit copies the trainable ones device to device."""

    def __init__(self, live: torch.nn.Module, device: torch.device | None = None):
        self.live = live
        home = next(live.parameters()).device
        device = device or home
        # requires_grad kept as the live model's: on the CPU, frozen weights take other kernels, whose
        # log-probs differ in the last bits (the engine runs under inference_mode, so nothing is recorded)
        self.model = copy.deepcopy(live, memo=frozen_shared(live) if device == home else moved(live, device))
        self.stream = GenerationStream(device)

    @torch.no_grad()
    def refit(self) -> None:
        """Copy the live trainable weights into the copy's own tensors (an engine over it keeps its
        references), ordered after the sampling queued on the copy and before the sampling that follows
        (across devices too: a copy between two GPUs waits for both devices' current streams, and the
        destination's waits for it)."""
        with self.stream.joined():
            for mine, theirs in zip(self.model.parameters(), self.live.parameters()):
                if theirs.requires_grad:
                    mine.copy_(theirs)


def frozen_shared(live: torch.nn.Module) -> dict[int, torch.Tensor]:
    """A deep copy's memo that keeps `live`'s frozen parameters as they are: the copy shares them."""
    return {id(param): param for param in live.parameters() if not param.requires_grad}


def moved(live: torch.nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """A deep copy's memo that gives every parameter and buffer of `live` a copy on `device`, made there
    directly (the live model's device never holds a second copy); tied weights stay tied."""
    memo: dict[int, torch.Tensor] = {id(param): torch.nn.Parameter(param.detach().to(device, copy=True),
                                                                   requires_grad=param.requires_grad)
                                     for param in live.parameters()}
    memo.update({id(buffer): buffer.to(device, copy=True) for buffer in live.buffers()})
    return memo


class ServedWeights:
    """Disaggregated: the generation servers that `engine` (the remote engine) drives hold the weights, so
    none are copied here; a refit pushes the live policy's weights to them with their version (the engine's
    weight_sync: disk or distributed)."""

    def __init__(self, live: torch.nn.Module, engine: GenerationEngine):
        self.live, self.engine = live, engine
        self.stream = GenerationStream(torch.device("cpu"))  # none: the thread queues no device work of its own

    def refit(self) -> None:
        self.engine.update_weights(self.live)


class PushedBetweenBatches(GenerationEngine):
    """The loop's handle on the servers generation ahead drives (disaggregated): it samples from them (the
    evaluation) and leaves every push to generation ahead's refit, between two batches: the loop's push after
    each update would change the servers' weights under the batch in progress."""

    def __init__(self, servers: GenerationEngine):
        self.servers = servers

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        return self.servers.generate(prompts, params)

    def update_weights(self, policy_model) -> None:
        """Nothing: `ServedWeights.refit` pushes, when generation ahead refits."""


@dataclass
class MadeBatch:
    """One step's batch as the thread made it, and the positions the synchronous run would have after it."""

    batch: ExperienceBatch
    metrics: dict[str, float]
    loader_state: dict  # the prompt stream right after this batch's draws
    maker_state: dict  # the inner maker's state right after it (a copy)


class GenerateAhead(ExperienceWrapper):
    """The configured maker run ahead of training in a thread (module docstring)."""

    def __init__(self, inner: ExperienceMaker, cfg: AsynchronousConfig, weights: GenerationWeights,
                 engine: GenerationEngine, policy: "Policy", total_steps: int, updates_per_step: int,
                 settings: dict[str, object]):
        super().__init__(inner)
        self.cfg, self.weights, self.engine, self.policy = cfg, weights, engine, policy
        self.total_steps, self.updates_per_step = total_steps, updates_per_step
        self.settings = settings  # `batch_settings`: saved with the batches, which a resume under others drops
        self.taken_state = inner.state_dict()  # the inner maker's state after the latest batch the trainer took
        self._changed = threading.Condition()  # guards everything below; notified on every change
        self._thread: threading.Thread | None = None
        self._ready: dict[int, MadeBatch] = {}
        self._next_step = 0  # the step the thread makes next
        self._generating = False  # a batch in progress, parked or not
        self._parked = False  # with partial rollouts: the batch in progress waits for the trainer's refit
        self._refit_wanted = False  # the trainer waits to refit: with partial rollouts the batch in progress parks
        self._failure: BaseException | None = None
        self._trainer_at = (0, 0)  # (step, policy version) at the trainer's latest request
        self._idle_s = 0.0  # the thread's waiting since the trainer last took a batch
        if cfg.partial_rollouts:  # `engine` is then a ResumableEngine
            engine.refit_wanted, engine.await_refit = lambda: self._refit_wanted, self._park

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        """Step `step`'s batch, made ahead; the trainer's `loader` is moved to where it stands after it."""
        if step >= self.total_steps:  # the thread stops at the run's last step: this batch would never come
            raise ValueError(f"step {step}: generation ahead makes batches for trainer.total_steps="
                             f"{self.total_steps} steps only")
        started = time.perf_counter()
        with self._changed:
            self._trainer_at = (step, self.policy.version)
            refit_s = self._refit() if self._thread is None or self.policy.version != self.engine.weights_version else 0.0
            if self._thread is None:
                self._start(loader, step)
            self._changed.notify_all()  # the trainer's progress may admit the next batch
            self._changed.wait_for(lambda: step in self._ready or self._failure is not None)
            if step not in self._ready:
                raise self._failure
            made = self._ready.pop(step)
            idle, self._idle_s = self._idle_s, 0.0
            ready = len(self._ready)
            # the next batch starts on the weights this step updates, however the threads are scheduled
            self._changed.wait_for(lambda: self._generating or self._settled())
        loader.load_state_dict(made.loader_state)
        self.taken_state = made.maker_state
        metrics = {**made.metrics, "async/trainer_wait_s": time.perf_counter() - started,
                   "async/generator_idle_s": idle, "async/refit_s": refit_s, "async/batches_ready": ready}
        if self.cfg.partial_rollouts and len(made.batch):  # dynamic sampling may have dropped every group
            metrics["async/parked_share"] = parked_share(made.batch)
        return made.batch, metrics

    def evaluate(self, loader: PromptLoader,
                 single_round: Callable[[PromptLoader], dict[str, float]]) -> dict[str, float]:
        """The inner maker's evaluation between two batches, on the current weights (a maker that
        evaluates its own way samples from the copy), the thread held back until it ends (the rewards
        and the device are the trainer's)."""
        with self._changed, self.weights.stream.joined():
            self._refit()
            return self.inner.evaluate(loader, single_round)

    def state_dict(self) -> dict:
        """The taken maker state and every batch made and not taken, once the thread made all admission allows
        (module docstring, the prompt stream): the trainer waits for the batch in progress."""
        with self._changed:
            self._changed.wait_for(self._settled)
            ready = [{"step": step, **vars(made)} for step, made in sorted(self._ready.items())]
        return {"inner": self.taken_state, "ready": ready, "settings": self.settings}

    def load_state_dict(self, state: dict) -> None:
        """The taken state, and the saved batches to be taken first, the thread to start after the last of them
        from its loader and maker state; dropped (regenerated) if made under other settings."""
        self.inner.load_state_dict(state["inner"])
        self.taken_state = state["inner"]
        if "ready" not in state:
            logger.info("the checkpoint holds no batches made ahead (saved by a synchronous run, or before checkpoints "
                        "held them): the batches that were in flight are regenerated under the restored weights")
            return
        changed = sorted(key for key in state["settings"].keys() | self.settings.keys()
                         if state["settings"].get(key) != self.settings.get(key))
        if state["ready"] and changed:
            logger.warning("dropping the checkpoint's %d batch(es) made ahead, made under other settings (%s): "
                           "regenerating them under the restored weights", len(state["ready"]), ", ".join(changed))
            return
        self._ready = {saved["step"]: MadeBatch(**{key: value for key, value in saved.items() if key != "step"})
                       for saved in state["ready"]}
        if self._ready:
            self.inner.load_state_dict(copy.deepcopy(self._ready[max(self._ready)].maker_state))

    def _refit(self) -> float:
        """Under the lock: wait for the batch in progress (with partial rollouts, for it to park), then give
        the engine the policy's version and weights; returns the seconds the copy (or the push) took."""
        self._refit_wanted = self.cfg.partial_rollouts
        self._changed.notify_all()
        self._changed.wait_for(lambda: not self._generating or self._parked)
        started = time.perf_counter()
        self.engine.weights_version = self.policy.version  # before the weights: a push to servers carries it
        self.weights.refit()
        self._refit_wanted = False
        self._changed.notify_all()  # a parked batch resumes
        return time.perf_counter() - started

    def _park(self) -> None:
        """The thread, its engine call's unfinished responses parked: the trainer refits the copy, then the
        call resumes. It stays in progress meanwhile: a save that comes before it resumed waits for it."""
        with self._changed:
            self._parked = True
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._refit_wanted)
            self._parked = False

    def _start(self, loader: PromptLoader, step: int) -> None:
        """The thread, from step `step` and `loader`'s position, or after the batches a resume restored."""
        ahead = copy.copy(loader)  # its own position in the stream; the rows are shared, read only
        if self._ready:
            ahead.load_state_dict(self._ready[max(self._ready)].loader_state)
            step = max(self._ready) + 1
        self._next_step = step
        run_compiled_calls_beside_tracing()
        self._thread = threading.Thread(target=self._produce, args=(ahead, step, torch.get_num_threads()),
                                        name="generate-ahead", daemon=True)
        self._thread.start()

    def _admitted(self, step: int) -> bool:
        """Whether step `step`'s batch may start on the engine's weights now (module docstring, admission)."""
        trainer_step, trainer_version = self._trainer_at
        trains_at = trainer_version + (step - trainer_step) * self.updates_per_step  # at most
        newest = self.policy.version == self.engine.weights_version
        return newest and trains_at - self.engine.weights_version <= self.cfg.max_staleness

    def _produce(self, loader: PromptLoader, first_step: int, threads: int) -> None:
        """The thread: each remaining step's batch in order, as admission allows, on the trainer's count of
        compute threads (a new thread starts with OpenMP's default, and another count sums floats in
        another order)."""
        torch.set_num_threads(threads)
        self.weights.stream.enter()
        try:
            for step in range(first_step, self.total_steps):
                with self._changed:
                    waiting = time.perf_counter()
                    self._changed.wait_for(lambda: self._admitted(step))
                    self._idle_s += time.perf_counter() - waiting
                    self._generating = True
                    self._changed.notify_all()  # the trainer that took the batch before may go on
                batch, metrics = self.inner.make_experience(loader, step)
                made = MadeBatch(batch, metrics, loader.state_dict(), copy.deepcopy(self.inner.state_dict()))
                with self._changed:  # in one step: a save finds the batch in progress or ready, never between
                    self._ready[step] = made
                    self._next_step = step + 1
                    self._generating = False
                    self._changed.notify_all()
        except BaseException as err:  # raised again in the trainer at its next request
            with self._changed:
                self._failure = err
                self._generating = False
                self._changed.notify_all()

    def _settled(self) -> bool:
        """Under the lock: whether the thread makes nothing more until the trainer moves on (not started, ended,
        failed, or waiting for admission)."""
        if self._generating:
            return False
        if self._thread is None or self._failure is not None:
            return True
        return self._next_step >= self.total_steps or not self._admitted(self._next_step)


def maker_state_across(state: dict, saved_ahead: bool, ahead: bool) -> dict:
    """A checkpoint's maker state for a run that generates ahead (`ahead`) or not, saved by one that did
    (`saved_ahead`) or not: generation ahead keeps the configured maker's state as {"inner": ...} beside its
    batches, so a resume that switches trainer.asynchronous.enabled unwraps or wraps it. Unwrapped, the
    batches made ahead are regenerated (the prompt stream stands where the last batch trained left it)."""
    if saved_ahead and not ahead:
        logger.info("the checkpoint was saved generating ahead of training: its %d batch(es) made ahead are "
                    "regenerated by this synchronous run", len(state.get("ready", ())))
        return state["inner"]
    return {"inner": state} if ahead and not saved_ahead else state


def parked_share(batch: ExperienceBatch) -> float:
    """The share of the batch's responses whose sampled tokens span more than one version (parked and resumed)."""
    sampled = batch.sampled
    newest = batch.generation_versions.masked_fill(~sampled, -1).amax(dim=1)
    oldest = batch.generation_versions.masked_fill(~sampled, torch.iinfo(torch.long).max).amin(dim=1)
    return (newest > oldest).float().mean().item()
