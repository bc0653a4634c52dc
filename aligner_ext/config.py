"""The run configuration: one typed tree of every component's own `Config`.

Defaults live in the component dataclasses; `conf/*.yaml` only overrides them. `load_config` composes
a YAML file from `conf/` (which lists the schema `run_schema` first in its defaults) with
command-line overrides (Hydra's override grammar), validated against this schema, so an unknown key or a wrong type fails before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aligner_ext.algorithms.advantages import GroupAdvantage
from aligner_ext.data.loader import DataConfig
from aligner_ext.experience.base import RolloutConfig
from aligner_ext.experience.dynamic_sampling import DynamicSamplingConfig
from aligner_ext.generation.hf import HFEngineConfig
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.base import PolicyConfig
from aligner_ext.models.tiny import TinyModelConfig
from aligner_ext.rewards.manager import RewardConfig
from aligner_ext.trainer.warmup import WarmupConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
SCHEMA_NAME = "run_schema"  # the typed schema every top-level YAML lists first in its defaults


@dataclass
class ModelConfig:
    """The policy's starting weights."""

    path: str | None = None  # HF checkpoint directory; unset = build, warm up and train the embedded tiny model
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # size of the embedded model
    warmup: WarmupConfig = field(default_factory=WarmupConfig)  # its supervised warm-up


@dataclass
class GeneratorConfig:
    """The engine that samples rollouts."""

    engine: str = "hf"  # registered generation engine
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)  # settings of the HF engine


@dataclass
class AlgorithmConfig:
    """Which plug-in fills each stage of the loop (names from the registries)."""

    experience_maker: str = "group_sampling"  # how rollouts are produced and scored
    experience_wrappers: list[str] = field(default_factory=lambda: ["dynamic_sampling"])  # wrappers around the maker, innermost first; each is active only when its own switch is on
    use_dynamic_sample: bool = False  # DAPO dynamic sampling: drop groups whose outcomes all agree, refill (docs/variants/dapo.md)
    dynamic_sample_max_gen_batches: int = 3  # generation batches per step at most; 0 = unbounded
    adv_estimator: str = "grpo"  # how rewards become per-token advantages
    loss: str = "clipped_pg"  # how a batch becomes a gradient


@dataclass
class TrainerConfig:
    """The loop: length, output, checkpoints, logs."""

    total_steps: int = 60  # RL steps (one batch of train_batch_size prompts each)
    output_dir: str = "runs"  # parent directory of runs
    run_name: str = "default"  # the run directory is <output_dir>/<run_name>
    seed: int = 0  # seeds torch, python and numpy RNGs and the per-step sampling
    save_every: int = 0  # checkpoint every k steps; 0 = only at the end
    keep_last: int = 2  # checkpoints kept on disk (older ones are deleted); 0 keeps all
    resume: bool = True  # continue from the run directory's latest checkpoint if there is one
    eval_every: int = 0  # held-out evaluation every k steps; 0 = only before and after training
    log_samples_every: int = 10  # write sample completions every k steps; 0 = never
    num_log_samples: int = 4  # completions written each time
    tensorboard: bool = True  # mirror metrics to TensorBoard (<run dir>/tensorboard)
    progress_bar: bool = True  # show a progress bar
    export_hf: bool = True  # write the final policy as an HF checkpoint (<run dir>/hf_model)


@dataclass
class RunConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    advantage: GroupAdvantage.Config = field(default_factory=GroupAdvantage.Config)
    loss: ClippedPGLoss.Config = field(default_factory=ClippedPGLoss.Config)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def load_config(name: str = "base", overrides: list[str] | None = None, config_dir: str | Path | None = None) -> RunConfig:
    """Compose `<config_dir>/<name>.yaml` with `overrides` and validate it against `RunConfig`.

    Raises ValueError naming the key for an unknown key, a wrong type or an invalid value.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import ConfigCompositionException

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
    directory = Path(config_dir or CONF_DIR).resolve()
    if not (directory / f"{name}.yaml").exists():
        raise FileNotFoundError(f"no config {name!r} in {directory}")
    where = f"config {name!r} with overrides {list(overrides or [])}"
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        try:
            composed = compose(config_name=name, overrides=list(overrides or []))
        except ConfigCompositionException as err:  # Hydra names the override; its cause says what is wrong
            raise ValueError(f"{where}: {err.__cause__ or err}") from err
    if OmegaConf.get_type(composed) is not RunConfig:
        raise ValueError(f"{directory / name}.yaml must list '{SCHEMA_NAME}' first in its defaults")
    try:  # Hydra lets `+key=value` add keys the schema lacks; merging into the schema rejects them
        validated = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(composed))
    except OmegaConfBaseException as err:
        raise ValueError(f"{where}: {err}") from err
    return OmegaConf.to_object(validated)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
