"""Config names -> objects. The only place that reads plug-in names from the config.

What a user can fix stops the build with a UserError (aligner_ext/errors.py), which the CLI prints as
one line: a plug-in name that does not resolve (`check_plugin_names`, before anything loads), sampled
evaluation with a maker of a dotted path that evaluates its own way (`check_evaluation`; a built-in
one is refused when the config loads), a reward entry that would never score (`RewardManager.check`,
once the data has loaded, before the model), a plug-in that refuses its settings (`construct`), a
training row the experience maker would fail on (`ExperienceMaker.check_rows`).
"""

from __future__ import annotations

import dataclasses
import linecache
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import aligner_ext.plugins  # noqa: F401 - registers the built-in plug-ins
from aligner_ext.algorithms.advantages import ADVANTAGES
from aligner_ext.config import RunConfig, settings
from aligner_ext.context import BuildContext
from aligner_ext.data.loader import PromptLoader, build_loader, build_val_loaders
from aligner_ext.data.tasks import builtin_rows
from aligner_ext.data.tasks.base import DRILLS
from aligner_ext.data.tokenizer import load_tokenizer
from aligner_ext.data.types import PromptRow
from aligner_ext.distributed import main_process_first, world_size
from aligner_ext.errors import ConfigError, ModelPathError, UserError, error_line
from aligner_ext.experience.ahead import (GenerateAhead, GenerationWeights, PushedBetweenBatches, ServedWeights,
                                          WeightsSnapshot, batch_settings)
from aligner_ext.experience.base import EXPERIENCE_MAKERS, EXPERIENCE_WRAPPERS, ExperienceMaker
from aligner_ext.experience.settings import own_evaluation_refusal, planned_updates_per_step
from aligner_ext.files import follow_umask
from aligner_ext.generation.base import ENGINES, GenerationEngine
from aligner_ext.generation.resumable import ResumableEngine
from aligner_ext.generation.sharded import split_across_ranks
from aligner_ext.losses.base import LOSSES, Loss
from aligner_ext.models import warmup_cache
from aligner_ext.models.base import POLICIES, Policy, Reference
from aligner_ext.models.hf import resolve_device
from aligner_ext.models.kernels import prepare_gpu_process
from aligner_ext.models.tiny import build_char_tokenizer, build_tiny_model
from aligner_ext.models.warmup import supervised_warmup
from aligner_ext.registry import load_dotted
from aligner_ext.rewards.manager import RewardManager
from aligner_ext.rules import Registered, rule_of
from aligner_ext.support import check_routing_replay, check_run, rollout_refusal
from aligner_ext.trainer.contracts import check_stages, step_stages
from aligner_ext.trainer.run_dir import EMBEDDED_MODEL

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Components:
    """Every object the loop uses, built from one RunConfig."""

    tokenizer: object
    policy: Policy
    reference: Reference | None
    engine: GenerationEngine
    generation_model: torch.nn.Module  # what the engine runs (`Policy.generation_model`), handed to it after each update
    rewards: RewardManager
    maker: ExperienceMaker
    advantage: object
    loss: Loss
    train_loader: PromptLoader
    val_loaders: dict[str, PromptLoader]  # the validation sets to evaluate, by name; {} when there is none


def generation_engine_name(cfg: RunConfig, model_config, device: torch.device) -> str:
    """`generator.engine`, with `auto` resolved: the rollout engine where the benchmarks measure it
    faster (docs/benchmarks.md: on a GPU, for a decoder it runs, on the HF backend or on the Megatron
    backend's shards, a mixture of experts there under expert parallelism too), else the HF engine,
    saying why where the model is what the rollout engine does not run."""
    if cfg.generator.engine != "auto":
        return cfg.generator.engine
    if device.type != "cuda":
        return "hf"
    reason = rollout_refusal(model_config)
    if reason:
        logger.info("generator.engine=auto: the HF engine generates, as the rollout engine does not run this "
                    "model (%s)", reason)
        return "hf"
    return "rollout"


def warmup_examples(cfg: RunConfig, rows: list[PromptRow]) -> list[tuple[list[dict[str, str]], str]]:
    """The embedded model's warm-up pairs for built-in `rows`: the maker's, then each wrapper's additions."""
    examples = EXPERIENCE_MAKERS.get(cfg.algorithm.experience_maker).warmup_examples(cfg, rows)
    reads = (frozenset(ADVANTAGES.get(cfg.algorithm.adv_estimator).reads)
             | frozenset(LOSSES.get(cfg.algorithm.loss).reads))  # as BuildContext.reads_after_experience
    for name in cfg.algorithm.experience_wrappers:
        examples = EXPERIENCE_WRAPPERS.get(name).wrap_warmup_examples(cfg, rows, examples, reads)
    return examples


def embedded_model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Build and warm up the embedded tiny model once per run; later calls (resume) reuse it, and a
    warm-up of the same inputs done before on this machine is copied from its cache (models/warmup_cache.py)."""
    directory = run_dir / EMBEDDED_MODEL
    if (directory / "config.json").exists():
        return directory
    tokenizer = build_char_tokenizer()
    device = resolve_device(cfg.policy.device)
    rows = builtin_rows(cfg.data.builtin_task, "train", cfg.data.builtin_train_size, cfg.data.seed)
    examples = warmup_examples(cfg, rows)
    drills = task_drills(cfg)
    cache = warmup_cache.cache_root(cfg.model.warmup.cache_dir)
    key = warmup_cache.warmup_key(cfg.model.tiny, cfg.model.warmup, examples + drills, device.type)
    if warmup_cache.fetch(cache, key, directory):
        return directory
    model = build_tiny_model(tokenizer, cfg.model.tiny).to(device)
    logger.info("warming up the embedded model on %d examples from %d %s rows%s", len(examples), len(rows),
                cfg.data.builtin_task, f", after {len(drills)} drills" if drills else "")
    supervised_warmup(model, tokenizer, examples, cfg.model.warmup, progress=cfg.trainer.progress_bar, drills=drills)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing it
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    follow_umask(tmp)
    tmp.rename(directory)
    warmup_cache.store(cache, key, directory)
    del model  # the policy backend loads its own copy from `directory`
    if torch.cuda.is_available():
        # Hand the warm-up's cached blocks back: other processes on this GPU (the run's other ranks,
        # or other runs) need them, and the caching allocator would otherwise keep them all run long.
        torch.cuda.empty_cache()
    return directory


def task_drills(cfg: RunConfig) -> list[tuple]:
    """The built-in task's drills for `model.warmup.drill_steps` steps (as many examples as the stage
    trains on), or none; a task without drills is refused in one line."""
    warmup = cfg.model.warmup
    if not warmup.drill_steps:
        return []
    if cfg.data.builtin_task not in DRILLS:
        raise ConfigError(f"model.warmup.drill_steps={warmup.drill_steps}: data.builtin_task={cfg.data.builtin_task} "
                          f"registers no drills (tasks with drills: {', '.join(DRILLS.names())}); set it to 0")
    return DRILLS.get(cfg.data.builtin_task)(warmup.drill_steps * warmup.batch_size, cfg.data.seed)


def model_directory(cfg: RunConfig, run_dir: Path) -> Path | str:
    """`model.path` checked (a local directory must hold config.json; anything else must load as a
    hub id), or the embedded model's directory."""
    if not cfg.model.path:
        with main_process_first():  # the main process warms up and writes it; the others read it
            return embedded_model_dir(cfg, run_dir)
    path = Path(cfg.model.path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(f"model.path {path} is not a transformers checkpoint: it has no config.json "
                                 "(expected config.json, the weights and the tokenizer files)")
        return path
    if path.exists():
        raise ModelPathError(f"model.path {path} is a file; it must be a directory with config.json, the weights "
                             "and the tokenizer")
    if cfg.model.path.startswith((".", "/", "~")) or cfg.model.path.count("/") != 1:
        raise ModelPathError(f"model.path {cfg.model.path} does not exist (a directory with config.json, the weights "
                             "and the tokenizer, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct)")
    try:
        AutoConfig.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as err:
        raise ModelPathError(f"model.path {cfg.model.path} is not a local directory and does not load as a hub id: "
                             f"{str(err).splitlines()[0]}") from err
    return cfg.model.path


def build_components(cfg: RunConfig, run_dir: Path) -> Components:
    """Every part of a run. What is cheap to check (the plug-in names, the model path, whether the backend
    and engine run the model, the data files, every row's reward function) is checked before the model
    loads; the plug-ins' settings, batch contracts (trainer/contracts.py) and the training rows against
    the experience maker once they are built, before the first step."""
    check_plugin_names(cfg)
    check_evaluation(cfg)
    model_dir = model_directory(cfg, run_dir)
    check_run(cfg, model_dir)  # the model's family and layout, from config.json alone (aligner_ext/support.py)
    if cfg.policy.routing_replay:
        model_config = AutoConfig.from_pretrained(model_dir)
        check_routing_replay(cfg, model_config, generation_engine_name(cfg, model_config,
                                                                       resolve_device(cfg.policy.device)))
    if resolve_device(cfg.policy.device).type == "cuda":
        prepare_gpu_process(cfg.policy.cudnn_attention)  # compile workers ready for the first compilation
    tokenizer = load_tokenizer(model_dir)
    train_loader = build_loader(cfg.data, tokenizer, "train")
    val_loaders = build_val_loaders(cfg.data, tokenizer, cfg.trainer.eval.sets)
    rewards = RewardManager(cfg.reward)
    try:
        rows = train_loader.rows + [row for loader in val_loaders.values() for row in loader.rows]
        rewards.check(EXPERIENCE_MAKERS.get(cfg.algorithm.experience_maker).rows_scored_by_rewards(cfg, rows))
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        vocab_size = model.get_output_embeddings().weight.shape[0]
        backend = cfg.policy.backend
        policy = construct(cfg, "policy backend", "policy.backend", backend, POLICIES.get(backend),
                           lambda cls: cls(model, cfg.policy, cfg.trainer.total_steps), section="policy")
        reference = policy.frozen_reference() if cfg.loss.kl_coef > 0 else None
        engine_name = generation_engine_name(cfg, model.config, policy.device)
        generation_model = policy.generation_model(engine_name)
        snapshot = weights_snapshot(cfg, engine_name, generation_model)  # before an engine re-points the model's tensors
        built = build_engine(cfg, engine_name, generation_model, tokenizer)
        engine = split_across_ranks(built, cfg.generator.split_across_ranks, getattr(generation_model, "split_group", None))
        engine, maker_engine, ahead_weights = generation_ahead_engines(cfg, engine_name, engine, built,
                                                                       generation_model, snapshot, tokenizer)
        ctx = BuildContext(cfg=cfg, tokenizer=tokenizer, policy=policy, engine=maker_engine, rewards=rewards,
                           vocab_size=vocab_size)
        advantage = construct(cfg, "advantage estimator", "algorithm.adv_estimator", cfg.algorithm.adv_estimator,
                              ADVANTAGES.get(cfg.algorithm.adv_estimator), lambda cls: cls.from_context(ctx))
        loss = construct(cfg, "loss", "algorithm.loss", cfg.algorithm.loss, LOSSES.get(cfg.algorithm.loss),
                         lambda cls: cls.from_context(ctx), section="loss")  # every loss reads the whole section
        ctx.reads_after_experience = frozenset(advantage.reads) | frozenset(loss.reads)
        maker = build_experience_maker(ctx)
        if ahead_weights is not None:
            maker = GenerateAhead(maker, cfg.trainer.asynchronous, ahead_weights, maker_engine, policy,
                                  cfg.trainer.total_steps, planned_updates_per_step(cfg), batch_settings(settings(cfg)))
        check_stages(step_stages(maker, reference is not None, advantage, cfg.algorithm.adv_estimator, loss,
                                 cfg.algorithm.loss))
        maker.check_rows(train_loader.rows)
    except BaseException:
        rewards.close()
        raise
    rewards.start()  # the workers start up while the first rollouts generate
    return Components(
        tokenizer=tokenizer, policy=policy, reference=reference, engine=engine, generation_model=generation_model,
        rewards=ctx.rewards,
        maker=maker, advantage=advantage, loss=loss, train_loader=train_loader, val_loaders=val_loaders,
    )


def build_engine(cfg: RunConfig, name: str, model: torch.nn.Module, tokenizer) -> GenerationEngine:
    """The generation engine `name` over `model`."""
    return construct(cfg, "generation engine", "generator.engine", name, ENGINES.get(name),
                     lambda cls: cls(model, tokenizer, getattr(cfg.generator, name)), section=f"generator.{name}")


def weights_snapshot(cfg: RunConfig, engine_name: str, generation_model: torch.nn.Module) -> WeightsSnapshot | None:
    """The copy of the generation model that generation ahead of training samples from when colocated
    (experience/ahead.py), or None: `trainer.asynchronous` off, or the engine drives servers that hold the
    weights (`remote`). Under torchrun only servers are driven ahead (`generation_ahead_engines`), without
    partial rollouts: a park aborts every request on the servers, the other ranks' too."""
    if not cfg.trainer.asynchronous.enabled:
        return None
    processes = world_size()
    if processes > 1 and engine_name != "remote":
        raise ConfigError(f"trainer.asynchronous.enabled=true under torchrun ({processes} processes) with "
                          f"generator.engine={engine_name}: a copy of the policy on each rank is not driven ahead "
                          "(its engine's collectives would interleave with training's); use generation servers "
                          "(generator.engine=remote), run one process, or set trainer.asynchronous.enabled=false")
    if processes > 1 and cfg.trainer.asynchronous.partial_rollouts:
        raise ConfigError(f"trainer.asynchronous.partial_rollouts=true under torchrun ({processes} processes): a park "
                          "aborts every request on the servers, the other ranks' too; set "
                          "trainer.asynchronous.partial_rollouts=false or run one process")
    if engine_name == "remote":
        return None
    return WeightsSnapshot(generation_model, generation_device(cfg.trainer.asynchronous.device))


def generation_device(name: str | None) -> torch.device | None:
    """The device `trainer.asynchronous.device` names, its index made explicit (cuda: the current one), or
    None (unset: the policy's); one line if this machine has no such device."""
    if name is None:
        return None
    device = torch.device(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None and count else device.index
    if index is None or index >= count:
        raise ConfigError(f"trainer.asynchronous.device={name}: this process sees {count} GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); name one of "
                          "them, or unset it to generate on the policy's device")
    return torch.device("cuda", index)


def generation_ahead_engines(cfg: RunConfig, engine_name: str, engine: GenerationEngine, built: GenerationEngine,
                             generation_model: torch.nn.Module, snapshot: WeightsSnapshot | None,
                             tokenizer) -> tuple[GenerationEngine, GenerationEngine, GenerationWeights | None]:
    """(the loop's engine, the experience maker's, the weights generation ahead refits; None: it is off).
    Colocated, the maker samples from the copy with an engine of its own. Disaggregated (remote), both sample
    from the servers (`built`: the engine before its split across ranks), and only generation ahead pushes
    to them, between two batches; under torchrun the maker's calls are split across the ranks over a gloo
    group of their own, so the generation thread's gathers never interleave with training's collectives
    (each rank's thread makes the same calls in the same order: admission follows the trainer's versions,
    not the threads' timing). With partial rollouts the maker's engine is resumable: it parks at a refit."""
    if not cfg.trainer.asynchronous.enabled:
        return engine, engine, None
    served = engine_name == "remote"
    if served:
        group = dist.new_group(backend="gloo") if world_size() > 1 else None  # every rank, in the same order
        maker_engine = split_across_ranks(built, cfg.generator.split_across_ranks, group)
    else:
        maker_engine = build_engine(cfg, engine_name, snapshot.model, tokenizer)
    if cfg.trainer.asynchronous.partial_rollouts:
        maker_engine = ResumableEngine(maker_engine, tokenizer)
    if served:
        return PushedBetweenBatches(engine), maker_engine, ServedWeights(generation_model, maker_engine)
    return engine, maker_engine, snapshot


def build_experience_maker(ctx: BuildContext) -> ExperienceMaker:
    """The configured maker, wrapped by each of `algorithm.experience_wrappers` in order (innermost first)."""
    name = ctx.cfg.algorithm.experience_maker
    maker = construct(ctx.cfg, "experience maker", "algorithm.experience_maker", name, EXPERIENCE_MAKERS.get(name),
                      lambda cls: cls.from_context(ctx))
    for name in ctx.cfg.algorithm.experience_wrappers:
        maker = construct(ctx.cfg, "experience wrapper", "algorithm.experience_wrappers", name,
                          EXPERIENCE_WRAPPERS.get(name), lambda cls: cls.from_context(maker, ctx))
    return maker


def check_evaluation(cfg: RunConfig) -> None:
    """Refuse sampled evaluation (trainer.eval, above k=1 at temperature 0) with an experience maker that
    evaluates its own way (`ExperienceMaker.own_evaluation`): it would ignore those settings. The config's
    load refuses it for a built-in maker already; this covers a maker of a dotted path."""
    name = cfg.algorithm.experience_maker
    problem = own_evaluation_refusal(name, EXPERIENCE_MAKERS.get(name).own_evaluation, cfg.trainer.eval)
    if problem is not None:
        raise ConfigError(problem)


def check_plugin_names(cfg: RunConfig) -> None:
    """Resolve every plug-in name of the config (a field declared with `rules.plugin` / `plugins`) now, before
    anything loads: the config check knows the registered names, but a dotted path `pkg.module:attr` is
    imported only here. A name that does not resolve is a ConfigError naming the key."""
    for key, field, value in _settings(cfg):
        rule = rule_of(field)
        if not isinstance(rule, Registered):
            continue
        registry = load_dotted(rule.registry)
        for name in value if rule.many else [value]:
            if name in rule.extra:
                continue
            try:
                registry.get(name)
            except (KeyError, ImportError, AttributeError, ValueError) as err:
                raise ConfigError(f"{key}={name}: {err.args[0] if err.args else err}") from err


def construct(cfg: RunConfig, kind: str, key: str, name: str, cls: Any, make: Callable[[Any], T],
              section: str | None = None) -> T:
    """`make(cls)`: the plug-in `name` of `kind`, chosen by the config key `key`. A ValueError or TypeError
    that the plug-in raises on purpose (a `raise` statement in its package) is about its settings, an
    ImportError so raised about a missing extra: it becomes a ConfigError naming the plug-in, its key and
    its settings' section (`section`, else the section holding `cls.Config`). Any other error is a bug
    and keeps its traceback."""
    try:
        return make(cls)
    except (ValueError, TypeError, ImportError) as err:
        packages = {"aligner_ext", getattr(cls, "__module__", "").split(".")[0]}
        if isinstance(err, UserError) or not _raised_on_purpose(err, packages):
            raise
        config_type = getattr(cls, "Config", None)
        section = section or next((key for key, _, value in _settings(cfg) if type(value) is config_type), None)
        settings = f"; its settings: {section}" if section else ""
        raise ConfigError(f"{kind} {name} ({key}{settings}) cannot be built: {error_line(err)}") from err


def _raised_on_purpose(err: BaseException, packages: set[str]) -> bool:
    """Whether `err` comes from a `raise` statement in one of `packages` (a message for the caller), rather
    than from an operation that failed (`None + 1`, a bad call into a library)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    return module.split(".")[0] in packages and line.lstrip().startswith("raise ")


def _settings(config: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every field of the dataclass tree `config`, sections before what they hold."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        yield prefix + field.name, field, value
        if dataclasses.is_dataclass(value):
            yield from _settings(value, f"{prefix}{field.name}.")
