"""The GRPO loop: prompts -> experience maker -> advantages -> loss -> optimizer step.

Each stage is a component chosen by config (`trainer/build.py`); the loop never learns which
variant is running. A step is numbered by the updates done: the evaluation before training is step 0.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from aligner_ext.batch import ExperienceBatch
from aligner_ext.config import RunConfig, as_tree, changed_settings, settings, to_yaml
from aligner_ext.distributed import init_from_env, is_main_process
from aligner_ext.errors import CheckpointError
from aligner_ext.experience.ahead import maker_state_across
from aligner_ext.files import attempt_write, follow_umask
from aligner_ext.models.base import DivergedRun
from aligner_ext.threads import compute_threads, usable_cores
from aligner_ext.trackers import build_trackers
from aligner_ext.trainer.build import Components, build_components
from aligner_ext.trainer.checkpoint import Checkpointer, CorruptCheckpoint
from aligner_ext.trainer.disk_space import check_free_space, estimate_writes, save_failed
from aligner_ext.trainer.evaluate import Evaluator
from aligner_ext.trainer.metrics import MetricsLogger, StageTimer, plot_history, read_history
from aligner_ext.trainer.no_learning import NoLearningDetector, run_warnings
from aligner_ext.trainer.run_dir import EXPORTED_MODEL, SAVED_CONFIG, SUMMARY, claim_run_dir
from aligner_ext.trainer.startup import startup_lines
from aligner_ext.trainer.step_metrics import batch_metrics

logger = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What a run reports at the end (also written to <run dir>/summary.json)."""

    run_dir: str
    steps: int
    accuracy_before: float
    accuracy_after: float
    reward_before: float
    reward_after: float
    train_seconds: float
    run_means: dict[str, float]  # run mean of each metric the experience maker lists in summary_metrics
    held_out_before: dict[str, float]  # every val/* metric of the evaluation before RL
    held_out_after: dict[str, float]  # and of the last evaluation
    evaluation: str = "greedy"  # how held-out responses were drawn (trainer.eval): "8 samples, temperature 0.7"
    reward_fallback_fraction: float = math.nan  # run mean of reward/fallback_fraction: rewards that were reward.fallback_score
    warnings: list[str] = field(default_factory=list)  # steps that could not learn, identical samples (trainer/no_learning.py)


def train(cfg: RunConfig) -> RunSummary:
    init_from_env()  # under torchrun: every process runs this loop; only the main one writes files
    threads = compute_threads(cfg.trainer.cpu_threads)
    torch.set_num_threads(threads)
    logger.info("%d compute thread(s) per process (trainer.cpu_threads; %d usable cores)", threads, usable_cores())
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.run_name
    checkpointer = Checkpointer(run_dir, cfg.trainer.keep_last, cfg.trainer.allow_unverified_checkpoint)
    start = claim_run_dir(cfg, run_dir, checkpointer)  # before anything is written there
    if start.finished:
        logger.warning("run directory %s: %s", run_dir, start.describe)
        return finished_summary(run_dir / SUMMARY)
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SAVED_CONFIG).write_text(to_yaml(cfg))
    torch.manual_seed(cfg.trainer.seed)
    parts = build_components(cfg, run_dir)
    if is_main_process():
        for line in startup_lines(cfg, parts, run_dir, start.describe):
            logger.info(line)
    start_step, before = resume(cfg, parts, checkpointer)
    writes = check_free_space(cfg, run_dir, estimate_writes(cfg, parts.policy, parts.tokenizer,
                                                            checkpointer.complete(), start_step))
    checkpointer.expected_bytes = writes.checkpoint
    log = MetricsLogger(run_dir, cfg.trainer.tensorboard, start_step, trackers=lambda: build_trackers(
        cfg.trainer.wandb, cfg.trainer.mlflow, cfg.trainer.run_name, run_dir, as_tree(cfg), settings(cfg)))
    evaluator = Evaluator(cfg, parts)
    if start_step == 0:
        before = evaluator(0)
        if before:
            log.log(0, before)
    temperature = cfg.rollout.temperature
    detector = NoLearningDetector(cfg.trainer.no_learning_steps, temperature, log=is_main_process())
    after = before
    started = time.perf_counter()
    progress = tqdm(range(start_step, cfg.trainer.total_steps), desc="GRPO", disable=not cfg.trainer.progress_bar,
                    initial=start_step, total=cfg.trainer.total_steps)
    with checkpointer.settled_on_error():  # a background save lands before an error leaves train()
        for step in progress:
            timer = StageTimer()
            with timer("rollout"):
                batch, metrics = parts.maker.make_experience(parts.train_loader, step)
            if len(batch):  # a filtering maker may keep nothing: then this step makes no update
                metrics.update(update_policy(parts, batch, timer, temperature))
            metrics.update(timer.metrics())
            metrics.update(parts.train_loader.metrics())
            metrics["timing/tokens_per_s"] = metrics.get("response/num_tokens", 0.0) / metrics["timing/step_s"]
            done = step + 1
            if evaluator.due(done):
                after = evaluator(done)
                metrics.update(after)
            checkpointer.poll()  # a background save is published once written; a failed one stops the run here
            log.log(done, metrics)
            detector.observe(done, metrics)
            progress.set_postfix_str(progress_line(metrics, after), refresh=False)
            if metrics.get("actor/diverged_updates", 0.0) > 0:  # the guard's verdict: these weights are never saved
                ratio = metrics["actor/update_ratio_max"]
                raise DivergedRun(
                    f"step {done}: an optimizer update changed the weights' norm by {ratio:.3g} of it "
                    f"(policy.optim.max_update_ratio={cfg.policy.optim.max_update_ratio}): the model diverged; "
                    "stopping without saving it (checkpoints/latest, if any, is the last good step). Lower "
                    "policy.optim.lr and resume")
            if len(batch) and cfg.trainer.log_samples_every and done % cfg.trainer.log_samples_every == 0:
                log.log_samples(done, batch, cfg.trainer.num_log_samples)
            if cfg.trainer.save_every and done % cfg.trainer.save_every == 0 and done < cfg.trainer.total_steps:
                save(cfg, parts, checkpointer, done, before, background=cfg.trainer.async_save)
    if start_step >= cfg.trainer.total_steps:  # resumed a finished run: nothing trained, evaluate again
        after = evaluator(start_step)
    save(cfg, parts, checkpointer, cfg.trainer.total_steps, before)
    if cfg.trainer.export_hf:
        export(parts, run_dir / EXPORTED_MODEL, writes.export)
    parts.rewards.close()
    if is_main_process():
        plot_history(run_dir / "metrics.jsonl", run_dir / "reward_accuracy.png", cfg.trainer.eval.describe())
    log.close(files=(run_dir / "reward_accuracy.png",))
    summary = RunSummary(
        run_dir=str(run_dir), steps=cfg.trainer.total_steps,
        accuracy_before=before.get("val/accuracy", math.nan), accuracy_after=after.get("val/accuracy", math.nan),
        reward_before=before.get("val/reward_mean", math.nan), reward_after=after.get("val/reward_mean", math.nan),
        train_seconds=time.perf_counter() - started,
        run_means=run_means(run_dir / "metrics.jsonl", parts.maker.summary_metrics),
        held_out_before=dict(before), held_out_after=dict(after), evaluation=cfg.trainer.eval.describe(),
        reward_fallback_fraction=run_means(run_dir / "metrics.jsonl", ("reward/fallback_fraction",))[
            "reward/fallback_fraction"],
        warnings=run_warnings(read_history(run_dir / "metrics.jsonl"), cfg.trainer.no_learning_steps, temperature),
    )
    if is_main_process():
        (run_dir / SUMMARY).write_text(json.dumps(json_safe(summary.__dict__), indent=2, allow_nan=False))
    return summary


def finished_summary(path: Path) -> RunSummary:
    """The summary a finished run wrote (`json_safe` stored NaN as null: read back as NaN)."""
    def nan_for_null(value):
        if isinstance(value, dict):
            return {key: nan_for_null(item) for key, item in value.items()}
        return math.nan if value is None else value

    return RunSummary(**nan_for_null(json.loads(path.read_text())))


def json_safe(value):
    """`value` with every NaN or infinite float replaced by None (JSON has no NaN: strict readers reject it)."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run_means(metrics_path: Path, keys: tuple[str, ...]) -> dict[str, float]:
    history = read_history(metrics_path)
    means = {}
    for key in keys:
        values = [record[key] for record in history if record.get(key) is not None]
        means[key] = sum(values) / len(values) if values else math.nan
    return means


def update_policy(parts: Components, batch: ExperienceBatch, timer: StageTimer, temperature: float) -> dict[str, float]:
    """Old and reference log-probs, advantages, the policy update, and the engine's new weights."""
    parts.engine.release_memory()  # what generation holds is freed while the policy trains
    if batch.generation_versions is not None:  # how many updates behind the proximal policy each token was sampled
        batch.staleness = (parts.policy.version - batch.generation_versions) * batch.sampled
    with timer("logprobs"):
        if not old_logprobs_from_training(parts, len(batch)):
            batch.old_logprobs, batch.entropy = parts.policy.logprobs(batch, temperature)
        if parts.reference is not None:
            batch.ref_logprobs = parts.reference.logprobs(batch, temperature)
    with timer("advantages"):
        batch.advantages = parts.advantage(batch)
    with timer("train"):
        metrics = parts.policy.train(batch, parts.loss, temperature)
    with timer("weight_sync"):
        parts.policy.sync_weights()
        refit_engine(parts)
    metrics.update(parts.advantage.metrics())
    metrics.update(batch_metrics(batch))
    return metrics


def refit_engine(parts: Components) -> None:
    """The engine samples from the policy's current weights, and knows their version (before the weights:
    a push to generation servers carries it)."""
    parts.engine.weights_version = parts.policy.version
    parts.engine.update_weights(parts.generation_model)


def old_logprobs_from_training(parts: Components, batch_size: int) -> bool:
    """Whether the old-log-prob pass can be skipped (`policy.old_logprob_pass=auto`): when the step is
    one optimizer update on the batch, the policy that trains is the one that generated, so the
    training forward's own log-probs, detached, are the old log-probs (ratio 1, as a recomputation
    would give up to rounding). Not when anything reads them before training (CPO's advantage)."""
    if not parts.policy.fills_old_logprobs(batch_size):
        return False
    read_before_training = {"old_logprobs", "entropy"} & set(getattr(parts.advantage, "reads", ()))
    return parts.policy.cfg.old_logprob_pass == "auto" and not read_before_training


def progress_line(metrics: dict[str, float], held_out: dict[str, float]) -> str:
    """The progress bar's postfix: this step's training reward, accuracy and time, the latest held-out accuracy."""
    parts = [f"reward {metrics['reward/mean']:.3f}"] if "reward/mean" in metrics else []
    if math.isfinite(metrics.get("reward/accuracy", math.nan)):
        parts.append(f"acc {100 * metrics['reward/accuracy']:.0f}%")
    parts.append(f"{metrics['timing/step_s']:.1f} s/step")
    if "val/accuracy" in held_out:
        parts.append(f"val acc {100 * held_out['val/accuracy']:.1f}%")
    return ", ".join(parts)


def save(cfg: RunConfig, parts: Components, checkpointer: Checkpointer, step: int, before: dict[str, float],
         background: bool = False) -> None:
    """Checkpoint step `step` (the weights alone with trainer.save_optimizer=false); `background`
    (trainer.async_save): return once its files are in memory, the next step starting while they are
    written (trainer/checkpoint.py). The final save is not in the background: the run ends, or exports,
    after it."""
    optimizer = cfg.trainer.save_optimizer
    state = {
        "policy": parts.policy.state_dict(optimizer),
        "loader": parts.train_loader.state_dict(),
        "maker": parts.maker.state_dict(),
        "eval_before": before,
        "config": to_yaml(cfg),
        "weights_only": not optimizer,
    }
    checkpointer.save(step, parts.policy.model, parts.tokenizer, state, background=background,
                      save_sharded=lambda directory, later: parts.policy.save_sharded(directory, later, optimizer))


def holds_optimizer(cfg: RunConfig, path: Path, state: dict) -> bool:
    """Whether checkpoint `path` (its trainer `state`) holds the optimizer's state. A weights-only one
    (trainer.save_optimizer=false) resumes only a run that asks for weights-only checkpoints too: the
    user chose to resume without exactness; otherwise one line says why it cannot resume exactly."""
    if not state.get("weights_only", False):  # older checkpoints lack the key: they hold it
        return True
    if cfg.trainer.save_optimizer:
        raise CheckpointError(
            f"checkpoint {path} holds the weights without the optimizer's state (saved with "
            "trainer.save_optimizer=false), so the run cannot resume exactly: resume it with "
            "trainer.save_optimizer=false (the optimizer starts afresh; the LR schedule, data order and RNG "
            "continue), or start afresh with trainer.resume=false")
    logger.warning("resuming from %s, a weights-only checkpoint: the optimizer's moments and master weights start "
                   "afresh (trainer.save_optimizer=false)", path)
    return False


def export(parts: Components, directory: Path, expected_bytes: int) -> None:
    """The final policy as an HF checkpoint; a failed write (disk full) removes what it wrote and stops in
    one line: the final checkpoint is saved, so the same command exports again."""
    def write() -> None:
        parts.policy.save_pretrained(str(directory))  # collective for sharded policies
        if is_main_process():
            parts.tokenizer.save_pretrained(str(directory))
            follow_umask(directory)

    failure = attempt_write(write)
    if failure is not None:
        if is_main_process():
            shutil.rmtree(directory, ignore_errors=True)
        raise save_failed("the export", directory, expected_bytes, failure, "the final checkpoint is saved: free "
                          "space or choose another trainer.output_dir, and rerun the same command to export it")


def resume(cfg: RunConfig, parts: Components, checkpointer: Checkpointer) -> tuple[int, dict[str, float]]:
    """Restore the newest checkpoint that verifies, if asked; returns (completed steps, the step-0
    evaluation). A corrupt checkpoint is named and skipped for the previous complete one."""
    candidates = checkpointer.complete() if cfg.trainer.resume else []
    if not candidates:
        return 0, {}
    failures = []
    for path in candidates:
        try:
            checkpointer.verify(path)
            state = checkpointer.load(path, None if parts.policy.restores_own_weights else parts.policy.model)
            break
        except CorruptCheckpoint as err:
            failures.append(str(err))
            logger.error("checkpoint %s is corrupt, trying the previous one: %s", path, err)
    else:
        raise CorruptCheckpoint("no complete checkpoint verifies: " + "; ".join(failures))
    # Announced here; the policy applies changed optimizer and schedule settings to the restored state.
    changes = changed_settings(state["config"], cfg) if "config" in state else []  # older checkpoints lack it
    if changes:
        logger.warning("resuming %s with %d setting(s) changed since it was saved: %s", path, len(changes),
                       "; ".join(changes))
    parts.policy.load_sharded(path, optimizer=holds_optimizer(cfg, path, state))
    parts.policy.load_state_dict(state["policy"])
    parts.train_loader.load_state_dict(state["loader"])
    saved_ahead = "config" in state and bool(OmegaConf.select(OmegaConf.create(state["config"]),
                                                               "trainer.asynchronous.enabled", default=False))
    parts.maker.load_state_dict(maker_state_across(state["maker"], saved_ahead, cfg.trainer.asynchronous.enabled))
    refit_engine(parts)
    return state["step"], state["eval_before"]
