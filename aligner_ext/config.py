"""The run configuration: one typed tree of every component's own `Config`.

Defaults live in the component dataclasses; `conf/*.yaml` only overrides them. `load_config` composes
a YAML file from `conf/` (which lists the schema `run_schema` first in its defaults) with
command-line overrides (Hydra's override grammar), validated against this schema, so an unknown key or a wrong type fails before anything runs.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from aligner_ext.agents.settings import AgentsConfig
from aligner_ext.algorithms.settings import AdvantageConfig, CPOConfig, check_group_size
from aligner_ext.data.settings import DataConfig, check_val_set_names
from aligner_ext.experience.settings import (AsynchronousConfig, DynamicSamplingConfig, GradedPromptConfig, RolloutConfig,
                                             TwoRoundConfig, check_asynchronous, check_evaluation, check_rollouts)
from aligner_ext.from_verl import VERL_ALIASES, VERL_SECTIONS, VERL_VALUE_ALIASES, no_equivalent
from aligner_ext.generation.settings import (MIN_TEMPERATURE, HFEngineConfig, RemoteEngineConfig, RolloutEngineConfig,
                                             check_remote_engine)
from aligner_ext.generation.vllm_colocated import VLLMEngineConfig
from aligner_ext.losses.settings import LossConfig, resolve_loss_settings
from aligner_ext.models.settings import PolicyConfig, TinyModelConfig, WarmupConfig, check_lora_engine
from aligner_ext.rewards.settings import RewardConfig
from aligner_ext.rules import check_settings, choice, number, numbers, plugin, plugins
from aligner_ext.secrets import read_secret, redact
from aligner_ext.trackers import MlflowConfig, WandbConfig
from aligner_ext.variants import active_variants, flatten, merge_variant_overrides, overlay_settings, resolve_variants

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
logger = logging.getLogger(__name__)

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

    engine: str = plugin("auto", "aligner_ext.generation.base:ENGINES", "auto")  # registered generation engine: hf (transformers' forward, token by token; the reference) | rollout (continuous batching over a KV cache, generation/rollout.py) | remote (OpenAI-compatible generation servers, generation/remote.py) | vllm (colocated in-process vLLM, extra vllm, generation/vllm_colocated.py) | auto (rollout on a GPU with a decoder of a family aligner_ext/architecture.py describes, docs/models.md, either backend (mixtures of experts: the HF backend), where it is measured faster; hf otherwise)
    split_across_ranks: bool = True  # under torchrun each process generates a contiguous share of every engine call and the outputs are all-gathered (aligner_ext/generation/sharded.py); false: every process generates everything
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)  # settings of the HF engine
    rollout: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)  # settings of the rollout engine
    remote: RemoteEngineConfig = field(default_factory=RemoteEngineConfig)  # settings of the remote engine (generation servers)
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)  # settings of the colocated vLLM engine (extra vllm; verified against a fake only)


@dataclass
class AlgorithmConfig:
    """Which plug-in fills each stage of the loop (names from the registries)."""

    experience_maker: str = plugin("group_sampling", "aligner_ext.experience.base:EXPERIENCE_MAKERS")  # how rollouts are produced and scored
    experience_wrappers: list[str] = plugins(["overlong", "dynamic_sampling", "hint_logprobs"], "aligner_ext.experience.base:EXPERIENCE_WRAPPERS")  # wrappers around the maker, innermost first; each is active only when its own switch is on
    adv_estimator: str = plugin("grpo", "aligner_ext.algorithms.advantages:ADVANTAGES")  # how rewards become per-token advantages
    loss: str = plugin("clipped_pg", "aligner_ext.losses.base:LOSSES")  # how a batch becomes a gradient


@dataclass
class EvalConfig:
    """Held-out evaluation (trainer/evaluate.py, docs/evaluation.md): when, how many responses, which sets."""

    every: int = number(0, ge=0)  # evaluate every N steps; 0 = only before training (step 0) and after the last step
    k: int = number(1, ge=1)  # responses per validation prompt; 1 at temperature 0 is greedy accuracy (the default); above 1 adds mean@k, pass@j and maj@k
    temperature: float = number(0.0, ge=0)  # sampling temperature; 0 = greedy (k must then be 1)
    top_p: float = number(1.0, gt=0, le=1)  # nucleus mass; 1.0 disables it
    pass_at: list[int] = numbers([], ge=1)  # the j of each pass@j reported (each <= k); empty: 1, 2, 4, ... below k, and k
    sets: list[str] = field(default_factory=list)  # names of data.val_sets to evaluate; empty: every validation set

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"trainer.eval.temperature={self.temperature:g}: must be 0 (greedy) or >= "
                             f"{MIN_TEMPERATURE:g} (logits divided by less overflow)")
        if self.k > 1 and self.temperature == 0:
            raise ValueError(f"trainer.eval.k={self.k} at trainer.eval.temperature=0: greedy decoding gives the same "
                             "response k times; set a temperature above 0, or k=1")
        if self.pass_at and self.k == 1:
            raise ValueError(f"trainer.eval.pass_at={list(self.pass_at)}: pass@j is reported for trainer.eval.k > 1")
        if any(j > self.k for j in self.pass_at):
            raise ValueError(f"trainer.eval.pass_at={list(self.pass_at)}: each must be at most trainer.eval.k={self.k}")

    def describe(self) -> str:
        """How responses are drawn, for the summary and the plot: `greedy`, or `8 samples, temperature 0.7`."""
        if self.k == 1 and self.temperature == 0:
            return "greedy"
        samples = "1 sample" if self.k == 1 else f"{self.k} samples"
        return f"{samples}, temperature {self.temperature:g}" + (f", top-p {self.top_p:g}" if self.top_p < 1 else "")


@dataclass
class TrainerConfig:
    """The loop: length, output, checkpoints, logs."""

    total_steps: int = number(60, ge=1)  # RL steps (one batch of train_batch_size prompts each)
    output_dir: str = "runs"  # parent directory of runs
    run_name: str = "auto"  # the run directory is <output_dir>/<run_name>; auto: the config's name and its variants (base, demo, demo_mtpo, base_cpo_dapo), so runs of different variants never share one
    seed: int = number(0, ge=0)  # seeds torch, python and numpy RNGs and the per-step sampling
    cpu_threads: int = number(0, ge=0)  # torch compute threads of each trainer process; 0 = the cores free when the run starts (its CPU affinity less the cores another process keeps busy; under torchrun the usable cores split among the machine's processes), aligner_ext/threads.py
    save_every: int = number(0, ge=0)  # checkpoint every k steps; 0 = only at the end
    keep_last: int = number(2, ge=0)  # checkpoints kept on disk (older ones are deleted); 0 keeps all. keep_last + 1 of them and the export must fit in the output directory's free space, checked before step 1
    save_optimizer: bool = True  # checkpoints hold the optimizer's state (AdamW's moments, float32 master weights), so a resume is exact; false saves the weights alone (at bf16 with float32 masters 2 bytes per parameter instead of 14): a resume then needs this false too and starts the optimizer afresh (docs/reliability.md)
    async_save: bool = True  # write checkpoints in the background: the next step starts once the files are in host memory (megatron-core's asynchronous save on the Megatron backend); costs one checkpoint's size of host memory (each rank its share) until written; false writes them before the next step
    resume: bool = True  # continue from the run directory's latest checkpoint if there is one
    allow_unverified_checkpoint: bool = False  # resume from a checkpoint without manifest.json (written before manifests): its files go unchecked
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation
    log_samples_every: int = number(10, ge=0)  # write sample completions every k steps; 0 = never
    num_log_samples: int = number(4, ge=0)  # completions written each time
    no_learning_steps: int = number(3, ge=1)  # warn (log and summary) when this many steps in a row cannot change the policy: no non-zero advantage, no update, a zero gradient or learning rate; one such step is ordinary (every group right), trainer/no_learning.py
    tensorboard: bool = True  # mirror metrics to TensorBoard (<run dir>/tensorboard)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases, off by default (aligner_ext/trackers.py)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # MLflow, off by default (aligner_ext/trackers.py)
    progress_bar: bool = True  # show a progress bar
    export_hf: bool = True  # write the final policy as an HF checkpoint (<run dir>/hf_model)
    asynchronous: AsynchronousConfig = field(default_factory=AsynchronousConfig)  # generation ahead of training (docs/async.md)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[\w.+=-]+", self.run_name) or self.run_name in (".", ".."):
            raise ValueError(f"trainer.run_name={self.run_name!r}: must be one directory name (letters, digits, "
                             "'_', '-', '.', '+', '='); the parent directory is trainer.output_dir")


@dataclass
class ServeConfig:
    """`aligner-ext serve` (serving/server.py): where it listens and what one request may ask."""

    host: str = "127.0.0.1"  # interface to bind; an address other than loopback (0.0.0.0 serves other machines) needs api_key, or allow_unauthenticated
    port: int = number(8000, ge=0, le=65535)  # TCP port
    allow_unauthenticated: bool = False  # serve without api_key on an address other than loopback: anyone who reaches the port can generate and replace the served weights
    api_key: str | None = field(default=None, repr=False)  # if set, requests need `Authorization: Bearer <api_key>` (all but /health); never written to the run directory (aligner_ext/secrets.py): prefer api_key_env / api_key_file
    api_key_env: str | None = None  # environment variable holding api_key (used when api_key is not given)
    api_key_file: str | None = None  # file whose first line is api_key (used when neither api_key nor api_key_env is given)
    model_name: str = "aligner-ext"  # the model id /v1/models lists and responses carry
    max_prompts_per_request: int = number(4096, ge=1)  # prompts in one completions request
    max_n: int = number(64, ge=1)  # samples per prompt
    max_tokens: int = number(32768, ge=1)  # cap on a request's max_tokens
    max_tokens_per_request: int = number(2**21, ge=1)  # cap on prompts x n x max_tokens, what one request may make the engine generate
    max_body_bytes: int = number(64 * 2**20, ge=1)  # request body size limit
    max_prompt_chars: int | None = number(None, ge=1)  # characters of one text prompt (of all a chat request's message strings), refused before tokenising; unset: 32 per position of the model
    request_timeout_s: float = number(600.0, gt=0)  # how long a request may wait for the engine before a 503
    weights_root: str | None = None  # /update_weights_from_disk loads only directories under this one (symlinks and .. resolved); unset: updates from disk are refused
    log_level: str = choice("warning", "critical", "error", "warning", "info", "debug", "trace")  # uvicorn's access and error log level

    def __post_init__(self) -> None:
        self.api_key = read_secret(self.api_key, self.api_key_env, self.api_key_file, "serve.api_key")
        if self.weights_root == "":
            raise ValueError("serve.weights_root is empty: name a directory, or leave it unset to refuse updates from disk")
        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: it may resolve to any interface
            loopback = False
        if not loopback and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(f"serve.host={self.host} is reachable from other machines and serve.api_key is unset, "
                             "so anyone could generate and replace the served weights: set serve.api_key_env or "
                             "serve.api_key_file, or serve.allow_unauthenticated=true to serve it open")


@dataclass
class RunConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    graded_prompt: GradedPromptConfig = field(default_factory=GradedPromptConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    mtpo: TwoRoundConfig = field(default_factory=TwoRoundConfig)
    cpo: CPOConfig = field(default_factory=CPOConfig)
    agents: AgentsConfig = field(default_factory=AgentsConfig)  # agent episodes (algorithm.experience_maker=agent_episodes)
    loss: LossConfig = field(default_factory=LossConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)  # `aligner-ext serve` only


# Keys of the frameworks the original recipes were written for -> our keys. `load_config` rewrites command-line
# overrides that name one (`apply_aliases`), and YAML settings of those inside one of our sections
# (`_move_recipe_keys`); a variant adds its original recipe's keys here.
ALIASES: dict[str, str] = {
    "actor_rollout_ref.rollout.enable_graded_system_prompt": "graded_prompt.enabled",
    "actor_rollout_ref.rollout.graded_system_prompt_full_reveal_count": "graded_prompt.full_reveal_count",
    "actor_rollout_ref.rollout.graded_system_prompt_step_power_n": "graded_prompt.step_power",
    "actor_rollout_ref.rollout.graded_system_prompt_step_sigmoid_start_point": "graded_prompt.sigmoid_start_point",
    "actor_rollout_ref.rollout.graded_system_prompt_step_sigmoid_steepness": "graded_prompt.sigmoid_steepness",
    "actor_rollout_ref.rollout.graded_system_prompt_add_base_when_zero": "graded_prompt.base_when_zero",
    "actor_rollout_ref.rollout.graded_system_prompt_participate_training": "graded_prompt.keep_in_training",
    "actor_rollout_ref.rollout.graded_system_prompt_include_evaluation_warning": "graded_prompt.include_evaluation_warning",
    "actor_rollout_ref.actor.cpo_lambda": "cpo.cpo_lambda",
    "actor_rollout_ref.actor.pos_alpha": "cpo.pos_alpha",
    "actor_rollout_ref.actor.neg_alpha": "cpo.neg_alpha",
    "actor_rollout_ref.actor.mi_alpha": "cpo.mi_alpha",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.actor.clip_ratio_c": "loss.clip_ratio_c",
    # DAPO (verl): prompts per step and samples per prompt; CPO (verl): the response cap
    "data.rollout_batch_size": "data.train_batch_size",
    "worker.rollout.n": "rollout.n",
    "data.max_response_length": "rollout.max_response_length",
    # MTPO (TRL-style GRPOConfig names); num_generations is G * H, as rollout.n
    "num_generations": "rollout.n",
    "beta": "loss.kl_coef",
    "epsilon": "loss.epsilon",
    "epsilon_high": "loss.epsilon_high",
    "num_iterations": "policy.num_iterations",
    "temperature": "rollout.temperature",
    "learning_rate": "policy.optim.lr",
    "max_prompt_length": "data.max_prompt_length",
    "max_completion_length": "rollout.max_response_length",
    # DAPO and CPO: the original recipes keep these variant settings under algorithm.*; ours live in the variant's own section
    "algorithm.use_dynamic_sample": "dynamic_sampling.enabled",
    "algorithm.dynamic_sample_max_gen_batches": "dynamic_sampling.max_gen_batches",
    "algorithm.gold_as_hint": "cpo.gold_as_hint",
    "algorithm.wrap_method": "cpo.wrap_method",
    # the evaluation's settings moved to their own section
    "trainer.eval_every": "trainer.eval.every",
    **VERL_ALIASES,  # verl's own keys (from_verl.py, docs/from_verl.md)
}
# Recipe keys whose values are named differently too: recipe key -> (our key, {recipe value: our value}).
VALUE_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    # TRL's loss_type: grpo averages each sequence's tokens, then the sequences; bnpo and dapo average
    # all tokens of the batch; dr_grpo sums each sequence's tokens (TRL then divides by a fixed length,
    # a constant factor: docs/variants/mtpo.md)
    "loss_type": ("loss.agg_mode", {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                                    "dr_grpo": "seq-mean-token-sum"}),
    # TRL's scale_rewards: divide by the group's std (true / "group") or only centre (false / "none")
    "scale_rewards": ("advantage.use_std", {"true": "true", "group": "true", "false": "false", "none": "false"}),
    **VERL_VALUE_ALIASES,
}
# Original recipes' keys inside one of our sections: a YAML file copied from one may set them too (`_move_recipe_keys`).
_SECTION_ALIASES = {theirs: ours for theirs, ours in ALIASES.items()
                    if theirs.split(".")[0] in RunConfig.__dataclass_fields__}
_OVERRIDE_PREFIX = re.compile(r"^(\+\+|\+|~)?")


def apply_aliases(overrides: list[str]) -> list[str]:
    """`overrides` with each key found in ALIASES replaced by ours (values untouched), and each key of
    VALUE_ALIASES replaced together with its value (an unknown value is a ValueError listing them).

    Alias targets are schema keys, so a leading `+` (add a new key) is dropped; `++` and `~` are kept.
    A verl key with no equivalent here is a ValueError saying what to use instead.
    Naming one setting by both its recipe key and ours, with different values, is a ValueError naming both.
    """
    rewritten, given = [], {}  # given: our key -> (the name it was first given by, its value)
    for override in overrides:
        prefix = _OVERRIDE_PREFIX.match(override).group(0)
        key, sep, value = override[len(prefix):].partition("=")
        if key in VALUE_ALIASES:
            ours, values = VALUE_ALIASES[key]
            if value.lower() not in values:
                raise ValueError(f"{key}={value}: accepted values are {', '.join(values)} (read as {ours})")
            key, value = ours, values[value.lower()]
        elif key in ALIASES:
            key = ALIASES[key]
        elif no_equivalent(key):
            raise ValueError(f"{key}: a verl key with no equivalent here: {no_equivalent(key)} (docs/from_verl.md)")
        else:
            rewritten.append(override)
            continue
        alias = ("" if prefix == "+" else prefix) + key + sep + value
        logger.info("override %r is read as %r (its name in the original recipe or verl)", override, alias)
        rewritten.append(alias)
    for original, override in zip(overrides, rewritten):  # `key` twice is Hydra's to judge; two names for it are ours
        name, key = (o.lstrip("+~").partition("=")[0] for o in (original, override))
        value = override.partition("=")[2]
        first_name, first_value = given.setdefault(key, (name, value))
        if first_name != name and first_value != value:
            raise ValueError(f"{first_name}={first_value} and {name}={value} set the same option {key}; give one")
    return rewritten


def load_config(name: str = "base", overrides: list[str] | None = None, config_dir: str | Path | None = None,
                for_training: bool = True) -> RunConfig:
    """Compose `<config_dir>/<name>.yaml` with `overrides` and validate it against `RunConfig`
    (`for_training`: also the rules only a training run needs, such as its lengths against the model's
    positions; `serve` checks each request's instead).

    Raises ValueError naming the key for an unknown key, a wrong type or an invalid value.
    Overrides naming a recipe key are first rewritten to ours (`apply_aliases`).
    """
    rewritten = apply_aliases(list(overrides or []))
    given = _given_names(list(overrides or []), rewritten)
    overrides = merge_variant_overrides(rewritten)
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import ConfigCompositionException, OverrideParseException

    ConfigStore.instance().store(name=SCHEMA_NAME, node=_schema())
    directory = Path(config_dir or CONF_DIR).resolve()
    if not (directory / f"{name}.yaml").exists():
        raise FileNotFoundError(f"no config {name!r} in {directory}")
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        try:
            composed = compose(config_name=name, overrides=list(overrides or []))
        except ConfigCompositionException as err:  # Hydra names the override; its cause says what is wrong
            raise ValueError(_one_line(err, name, overrides)) from err
        except OverrideParseException as err:  # Hydra's grammar names no override: find the one it cannot read
            raise ValueError(_unreadable(overrides, err)) from err
    if OmegaConf.get_type(composed) is not RunConfig:
        raise ValueError(f"{directory / name}.yaml must list '{SCHEMA_NAME}' first in its defaults")
    tree = OmegaConf.to_container(composed)
    _move_recipe_keys(tree, overrides)
    try:  # Hydra lets `+key=value` add keys the schema lacks; merging into the schema rejects them
        validated = OmegaConf.merge(OmegaConf.structured(RunConfig), tree)
    except OmegaConfBaseException as err:
        raise ValueError(_one_line(err, name, overrides)) from err
    cfg = OmegaConf.to_object(validated)
    check_settings(cfg)
    check_across_sections(cfg, for_training, given, overlay_settings(overrides, directory))
    if cfg.trainer.run_name == "auto":
        cfg.trainer.run_name = "_".join([Path(name).name, *sorted(active_variants(cfg))])
    return cfg


def _given_names(overrides: list[str], rewritten: list[str]) -> dict[str, str]:
    """{our key: the name the command line gave it by} for every setting `overrides` set, `rewritten` being
    them as `apply_aliases` reads them (an alias's own name kept, so that a refusal can quote it)."""
    def key(override: str) -> str:
        return override.lstrip("+~").partition("=")[0]

    return {key(ours): key(given) for given, ours in zip(overrides, rewritten) if key(ours) != "variant"}


def _prefixes(dotted: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`, `a.b.c`]: a misspelt section is matched against sections."""
    parts = dotted.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def _unreadable(overrides: list[str], err: Exception) -> str:
    """One line naming the override Hydra's grammar cannot read (a value holding '=', brackets, quotes or
    spaces), and how to write it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()

    def readable(override: str) -> bool:
        try:
            parser.parse_override(override)
        except Exception:  # noqa: BLE001 - any parse failure marks the culprit
            return False
        return True

    culprit = next((override for override in overrides if not readable(override)), " ".join(overrides))
    key, _, value = culprit.partition("=")
    return (f"cannot read the override {culprit!r} ({str(err).splitlines()[0]}): quote a value holding '=', "
            f"brackets, quotes or spaces, e.g. {key}='{value}'")


def _one_line(err: BaseException, name: str, overrides: list[str]) -> str:
    """Hydra's or OmegaConf's error (a paragraph, the key in a cause) as one line naming the key, and the
    config file when no override set it; an unknown key gets a did-you-mean."""
    while getattr(err, "full_key", None) is None and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    full_key = getattr(err, "full_key", None)
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if not full_key:
        return f"config {name!r} with overrides {overrides}: {first_line}"
    given = [key for key in (override.lstrip("+~").partition("=")[0] for override in overrides)
             if key == full_key or key.startswith(full_key + ".")]
    key = given[0] if given else full_key  # OmegaConf names a missing section, the override the whole key
    where = key if given else f"{key} (in config {name!r})"
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        known = {prefix for setting in settings(RunConfig()) for prefix in _prefixes(setting)}
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else " (`aligner-ext config --reference` lists every key)"
        if key.split(".")[0] in VERL_SECTIONS:
            hint += "; docs/from_verl.md maps verl's keys to ours"
        return f"{where}: no such setting{hint}"
    return f"{where}: {first_line}"


def _schema():
    """`RunConfig` admitting the original recipes' keys of `_SECTION_ALIASES`, so that YAML naming them composes; they and
    their targets start unset (`???`), so `_move_recipe_keys` sees which of the two names a file set."""
    schema = OmegaConf.structured(RunConfig)
    for recipe_key, ours in _SECTION_ALIASES.items():
        OmegaConf.update(schema, recipe_key, "???", force_add=True)
        OmegaConf.update(schema, ours, "???")
    return schema


def _move_recipe_keys(tree: dict, overrides: list[str]) -> None:
    """In the composed `tree`, give each of our keys that `_schema` left unset its recipe key's value, or else
    drop it so that the schema's default applies. An override of our key wins (it comes last); both names
    set in YAML to different values is a ValueError naming both."""
    overridden = {override.lstrip("+~").partition("=")[0] for override in overrides}
    for recipe_key, ours in _SECTION_ALIASES.items():
        recipe_parent, recipe_name = _parent(tree, recipe_key)
        parent, name = _parent(tree, ours)
        value = recipe_parent.pop(recipe_name)
        if value != "???" and ours not in overridden:
            if parent[name] not in ("???", value):
                raise ValueError(f"{recipe_key}={value} and {ours}={parent[name]} set the same option; give one")
            logger.info("%s=%s is read as %s (its name in the original recipe or verl)", recipe_key, value, ours)
            parent[name] = value
    for recipe_key, ours in _SECTION_ALIASES.items():  # after all of them: two recipe keys may name one of ours
        parent, name = _parent(tree, ours)
        if parent.get(name) == "???":
            del parent[name]
        sections = recipe_key.split(".")[:-1]
        for depth in range(len(sections), 1, -1):  # a section only recipe keys made (verl's algorithm.filter_groups)
            holder, section = _parent(tree, ".".join(sections[:depth]))
            if holder.get(section) == {}:
                del holder[section]


def _parent(tree: dict, dotted: str) -> tuple[dict, str]:
    """The section of `tree` holding the dotted key, and the key's last name."""
    *sections, name = dotted.split(".")
    for part in sections:
        tree = tree[part]
    return tree, name


def check_across_sections(cfg: RunConfig, for_training: bool = True, given: dict[str, str] | None = None,
                          from_overlays: frozenset[str] = frozenset()) -> None:
    """Checks that involve more than one section, so that `aligner-ext config` refuses what a run would
    (and the settings inferred from others: the graded maker from its switch, `variants.py`; the loss's
    aggregation mode); `given` and `from_overlays`: the keys the command line and the variant overlays set
    (`variants.check_unread`)."""
    resolve_variants(cfg, given, from_overlays)
    resolve_loss_settings(cfg.algorithm.loss, cfg.loss)
    check_evaluation(cfg.algorithm.experience_maker, cfg.trainer.eval)
    check_rollouts(cfg)
    check_remote_engine(cfg.generator.engine, cfg.generator.remote)
    check_lora_engine(cfg.policy.lora, cfg.generator.engine)
    check_group_size(cfg)
    check_val_set_names(cfg.data, cfg.trainer.eval.sets)
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    if cfg.policy.mini_batch_size > sequences:
        raise ValueError(f"policy.mini_batch_size={cfg.policy.mini_batch_size}: larger than a step's batch "
                         f"(data.train_batch_size x rollout.n = {sequences} sequences); 0 = the whole batch")
    if cfg.algorithm.experience_maker in ("two_round", "mtpo"):
        groups = cfg.mtpo.num_answer_generations * cfg.mtpo.num_confidence_generations
        if cfg.rollout.n != groups:
            raise ValueError(f"rollout.n={cfg.rollout.n}: two-round rollouts make mtpo.num_answer_generations x "
                             f"mtpo.num_confidence_generations = {groups} samples per prompt; set rollout.n={groups}")
    if cfg.algorithm.experience_maker in ("agent_episodes", "agents") and cfg.policy.expert_model_parallel_size > 1:
        raise ValueError(f"policy.expert_model_parallel_size={cfg.policy.expert_model_parallel_size} with "
                         "algorithm.experience_maker=agent_episodes: turn sessions do not run under expert "
                         "parallelism yet; leave it at 1")
    if cfg.algorithm.experience_maker in ("agent_episodes", "agents") and cfg.agents.agent and cfg.policy.routing_replay:
        raise ValueError(f"policy.routing_replay=true with agents.agent={cfg.agents.agent}: the agent endpoint does not "
                         "record the experts; leave routing replay off, or play the episodes with an environment")
    if for_training:  # a server never trains: it serves whatever the trainer's shared config says of training ahead
        check_asynchronous(cfg, active_variants(cfg))
        check_positions(cfg)


def check_positions(cfg: RunConfig) -> None:
    """The longest prompt plus the longest response must fit the model's positions (the embedded model's
    size, or `max_position_embeddings` of model.path's config.json, read without loading the model)."""
    if cfg.model.path is None:
        positions, source = cfg.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    else:
        config_file = Path(cfg.model.path) / "config.json"
        if not config_file.is_file():
            return  # the model loader names a missing or malformed checkpoint
        try:
            model_config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            return
        rope = model_config.get("rope_parameters") or model_config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) == "dynamic":
            return  # dynamic NTK scaling grows its base past max_position_embeddings (support.long_context_warning)
        positions, source = model_config.get("max_position_embeddings"), f"max_position_embeddings of {config_file}"
        if not isinstance(positions, int):
            return
    if cfg.algorithm.experience_maker in ("two_round", "mtpo"):
        response, response_keys = (cfg.mtpo.max_answer_length + cfg.mtpo.max_confidence_length,
                                   "mtpo.max_answer_length + mtpo.max_confidence_length")
    elif cfg.algorithm.experience_maker in ("agent_episodes", "agents"):
        if cfg.agents.limits.max_total_tokens > positions:
            raise ValueError(f"agents.limits.max_total_tokens={cfg.agents.limits.max_total_tokens}: more than the "
                             f"model's {positions} positions ({source})")
        return
    else:
        response, response_keys = cfg.rollout.max_response_length, "rollout.max_response_length"
    if cfg.data.max_prompt_length + response > positions:
        raise ValueError(f"data.max_prompt_length + {response_keys} = {cfg.data.max_prompt_length} + {response} "
                         f"tokens: more than the model's {positions} positions ({source})")


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML, secrets redacted (aligner_ext/secrets.py): what config.yaml and checkpoints hold."""
    return OmegaConf.to_yaml(as_tree(cfg))


def as_tree(cfg: RunConfig) -> dict:
    """The config as nested plain containers, secrets redacted (what trackers record)."""
    return redact(OmegaConf.to_container(OmegaConf.structured(cfg)))


def settings(cfg: RunConfig) -> dict:
    """The config as {dotted key: value}."""
    return flatten(as_tree(cfg))


def changed_settings(saved_yaml: str, cfg: RunConfig, among: tuple[str, ...] = ("",)) -> list[str]:
    """`key: saved -> current` for every setting of `cfg` that differs from a saved `to_yaml` text, so a
    resume can say what it changed (a new layout is expected; a new learning rate may not be); `among`:
    only keys starting with one of these."""
    saved = flatten(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    current = settings(cfg)
    missing = "(absent)"
    return [f"{key}: {saved.get(key, missing)} -> {current.get(key, missing)}"
            for key in sorted(saved.keys() | current.keys())
            if key.startswith(among) and saved.get(key, missing) != current.get(key, missing)]
