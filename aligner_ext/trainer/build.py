"""Config names -> objects. The only place that reads plug-in names from the config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aligner_ext.algorithms.advantages import ADVANTAGES
from aligner_ext.config import RunConfig
from aligner_ext.data import build_loader, builtin_rows
from aligner_ext.data.loader import PromptLoader
import aligner_ext.plugins  # noqa: F401 - registers the built-in plug-ins
from aligner_ext.context import BuildContext
from aligner_ext.distributed import main_process_first
from aligner_ext.experience.base import EXPERIENCE_MAKERS, EXPERIENCE_WRAPPERS, ExperienceMaker
from aligner_ext.generation.base import ENGINES, GenerationEngine
from aligner_ext.generation.sharded import split_across_ranks
from aligner_ext.losses.base import LOSSES, Loss
from aligner_ext.models.base import POLICIES, Policy
from aligner_ext.models.hf import FrozenReference, resolve_device
from aligner_ext.models.tiny import build_char_tokenizer, build_tiny_model
from aligner_ext.rewards.manager import RewardManager
from aligner_ext.trainer.warmup import supervised_warmup

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """Every object the loop uses, built from one RunConfig."""

    tokenizer: object
    policy: Policy
    reference: FrozenReference | None
    engine: GenerationEngine
    rewards: RewardManager
    maker: ExperienceMaker
    advantage: object
    loss: Loss
    train_loader: PromptLoader
    val_loader: PromptLoader | None  # None when there is no validation set


def embedded_model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Build and warm up the embedded tiny model once per run; later calls (resume) reuse it."""
    directory = run_dir / "base_model"
    if (directory / "config.json").exists():
        return directory
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, cfg.model.tiny).to(resolve_device(cfg.policy.device))
    rows = builtin_rows(cfg.data.builtin_task, "train", cfg.data.builtin_train_size, cfg.data.seed)
    examples = EXPERIENCE_MAKERS.get(cfg.algorithm.experience_maker).warmup_examples(cfg, rows)
    logger.info("warming up the embedded model on %d examples from %d %s rows", len(examples), len(rows),
                cfg.data.builtin_task)
    supervised_warmup(model, tokenizer, examples, cfg.model.warmup, progress=cfg.trainer.progress_bar)
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)
    del model  # the policy backend loads its own copy from `directory`
    if torch.cuda.is_available():
        # Hand the warm-up's cached blocks back: other processes on this GPU (the run's other ranks,
        # or other runs) need them, and the caching allocator would otherwise keep them all run long.
        torch.cuda.empty_cache()
    return directory


def build_components(cfg: RunConfig, run_dir: Path) -> Components:
    if cfg.model.path:
        model_dir = Path(cfg.model.path)
    else:
        with main_process_first():  # the main process warms up and writes it; the others read it
            model_dir = embedded_model_dir(cfg, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = POLICIES.get(cfg.policy.backend)(model, cfg.policy, cfg.trainer.total_steps)
    reference = None
    if cfg.loss.kl_coef > 0:
        reference = FrozenReference(policy.model, cfg.policy.logprob_chunk_size, cfg.policy.micro_batch_size)
    engine_cfg = getattr(cfg.generator, cfg.generator.engine)
    engine = split_across_ranks(ENGINES.get(cfg.generator.engine)(policy.model, tokenizer, engine_cfg),
                                cfg.generator.split_across_ranks)
    ctx = BuildContext(cfg=cfg, tokenizer=tokenizer, policy=policy, engine=engine, rewards=RewardManager(cfg.reward))
    return Components(
        tokenizer=tokenizer, policy=policy, reference=reference, engine=engine, rewards=ctx.rewards,
        maker=build_experience_maker(ctx),
        advantage=ADVANTAGES.get(cfg.algorithm.adv_estimator).from_context(ctx),
        loss=LOSSES.get(cfg.algorithm.loss).from_context(ctx),
        train_loader=build_loader(cfg.data, tokenizer, "train"),
        val_loader=build_loader(cfg.data, tokenizer, "val"),
    )


def build_experience_maker(ctx: BuildContext) -> ExperienceMaker:
    """The configured maker, wrapped by each of `algorithm.experience_wrappers` in order (innermost first)."""
    maker = EXPERIENCE_MAKERS.get(ctx.cfg.algorithm.experience_maker).from_context(ctx)
    for name in ctx.cfg.algorithm.experience_wrappers:
        maker = EXPERIENCE_WRAPPERS.get(name).from_context(maker, ctx)
    return maker
