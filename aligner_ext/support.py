"""Whether a run's model runs on its policy backend and generation engine, decided from config.json
alone, before the tokenizer or any weight loads (trainer/build.py calls `check_run` as soon as the
model directory is known). Under torchrun every rank reads the same config.json, so every rank
refuses alike and the CLI prints the line once (rank 0) with exit status 2.

What runs what: the HF backend and the HF engine run every model transformers runs; the Megatron
backend and the rollout engine run the families of `aligner_ext/architecture.py` (`architecture()` names
the first field outside them) as far as the Megatron backend's own checks agree
(`transformer_config()`). docs/models.md is generated from these
functions (scripts/gen_models_doc.py).
"""

from __future__ import annotations

import logging
import math
from importlib import metadata
from pathlib import Path

from transformers import AutoConfig

from aligner_ext.distributed import is_main_process, launched_world_size
from aligner_ext.errors import ConfigError
from aligner_ext.architecture import FAMILIES, UnsupportedModel, architecture
from aligner_ext.models.moe import check_aux_loss, is_moe
from aligner_ext.variants import active_variants

MEGATRON_CORE_RELEASE = "0.19"  # the release the Megatron backend runs on and is tested with (setup.py's extra)

logger = logging.getLogger(__name__)

HF_RUNS_IT = "policy.backend=hf runs it"
SCALED_PER_BATCH = ("dynamic", "longrope")  # rope types transformers recomputes from each batch's longest sequence


def family_label(hf_config) -> str:
    """"Qwen3 (qwen3)": how messages name a model."""
    family = FAMILIES.get(hf_config.model_type)
    return f"{family.name} ({hf_config.model_type})" if family else repr(hf_config.model_type)


def rollout_refusal(hf_config) -> str | None:
    """Why the rollout engine does not run this model (`architecture`'s one line naming what does), or
    None. It runs what it runs on either policy backend, under any layout of the Megatron backend
    (a mixture of experts under expert parallelism too: generation/decoder.py::ExpertExchange)."""
    try:
        architecture(hf_config)
    except UnsupportedModel as err:
        return str(err)
    return None


def _any_divisor_of(value: int, key: str) -> str:
    """"policy.<key>=1, 2 or 4 runs it" for the divisors of `value`."""
    divisors = [str(d) for d in range(1, value + 1) if value % d == 0]
    choices = divisors[0] if len(divisors) == 1 else f"{', '.join(divisors[:-1])} or {divisors[-1]}"
    return f"policy.{key}={choices} runs it"


def layout_refusal(hf_config, tp: int, pp: int, world: int) -> str | None:
    """Why the Megatron backend cannot split this model TP x PP ways over `world` processes, or None:
    TP splits whole key/value heads, MLP columns and padded vocabulary rows; PP whole layers."""
    from aligner_ext.models.megatron.convert import tp_split_sizes
    from aligner_ext.models.megatron.model import VOCAB_DIVISIBLE_BY

    label = family_label(hf_config)
    padded_vocab = math.ceil(hf_config.vocab_size / VOCAB_DIVISIBLE_BY) * VOCAB_DIVISIBLE_BY
    vocabulary = f"the vocabulary padded to a multiple of {VOCAB_DIVISIBLE_BY} (vocab_size={hf_config.vocab_size})"
    splits = {**tp_split_sizes(hf_config, architecture(hf_config)), vocabulary: padded_vocab}
    whole = math.gcd(*splits.values())
    for field, value in splits.items():
        if value % tp:
            return (f"{label}: policy.tensor_model_parallel_size={tp} does not divide {field}={value}; "
                    f"{_any_divisor_of(whole, 'tensor_model_parallel_size')}")
    layers = hf_config.num_hidden_layers
    if layers % pp:
        return (f"{label}: policy.pipeline_model_parallel_size={pp} does not divide num_hidden_layers={layers}; "
                f"{_any_divisor_of(layers, 'pipeline_model_parallel_size')}")
    if world % (tp * pp):
        return (f"policy.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} does not divide the "
                f"{world} processes of this run; torchrun --nproc_per_node with a multiple of {tp * pp} runs it")
    return None


def megatron_refusal(hf_config, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                     world: int = 1) -> str | None:
    """Why the Megatron backend does not run this model at this layout (one line naming what does), or None."""
    try:
        architecture(hf_config)
    except UnsupportedModel as err:
        return str(err)
    layout = layout_refusal(hf_config, tp, pp, world)
    if layout:
        return layout
    import torch

    from aligner_ext.models.megatron.model import transformer_config

    try:  # the backend's own word on the config: what it builds, no weights
        transformer_config(hf_config, tp, pp, torch.float32, sequence_parallel=sequence_parallel)
    except ValueError as err:
        reason = str(err).splitlines()[0]
        return f"{family_label(hf_config)}: the Megatron backend does not build it ({reason}); {HF_RUNS_IT}"
    return None


def long_context_warning(hf_config, longest: int) -> str | None:
    """The warning for sequences of up to `longest` tokens on a model whose RoPE transformers
    recomputes per batch (aligner_ext/architecture.py: dynamic and LongRoPE), or None where they stay
    within the length it switches at: `original_max_position_embeddings` for LongRoPE (its short
    factors below, long ones above), `max_position_embeddings` for dynamic NTK (its base below)."""
    # transformers >= 5: `rope_parameters` (per layer type where there are several); 4.x: `rope_scaling`
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    groups = params.values() if all(isinstance(value, dict) for value in params.values()) else [params]
    for group in groups:
        rope_type = (group or {}).get("rope_type", (group or {}).get("type"))
        if rope_type not in SCALED_PER_BATCH:
            continue
        if rope_type == "longrope":
            field = "original_max_position_embeddings"
            limit = group.get(field) or getattr(hf_config, field, None) or hf_config.max_position_embeddings
        else:
            field, limit = "max_position_embeddings", hf_config.max_position_embeddings
        if longest > limit:
            return (f"{family_label(hf_config)}: rope_type={rope_type} changes its frequencies past "
                    f"{field}={limit} and data.max_prompt_length + rollout.max_response_length = {longest}: "
                    "transformers recomputes them from each batch's longest sequence, the Megatron backend and "
                    "the rollout engine keep those of shorter ones, so log-probs of sequences past "
                    f"{limit} tokens differ between them (docs/models.md)")
    return None


def check_engine(engine: str, hf_config) -> None:
    """Refuse (`UnsupportedModel`, one line) a model an explicit `generator.engine=rollout` does not run
    (`aligner-ext train` and `aligner-ext serve`, whose model is an HF one, both ask, before any weight
    loads)."""
    reason = rollout_refusal(hf_config) if engine == "rollout" else None
    if reason:
        raise UnsupportedModel(reason)


def check_megatron_core(installed: str | None = None) -> None:
    """Refuse (one line) a megatron-core other than the release the Megatron backend runs on; `installed`:
    its version ("" for none), read from the installed packages by default."""
    if installed is None:
        try:
            installed = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            installed = ""
    if installed.split(".")[:2] == MEGATRON_CORE_RELEASE.split("."):
        return
    found = f"{installed} is installed" if installed else "it is not installed"
    raise ConfigError(f"policy.backend=megatron needs megatron-core {MEGATRON_CORE_RELEASE} ({found}): pip install "
                      "'aligner_ext[megatron]', under Python >= 3.12")


def check_run(cfg, model_dir: Path | str) -> None:
    """Refuse (`UnsupportedModel`, one line) a model of `model_dir` that the run's Megatron backend or
    explicit rollout engine does not run, or a layout the backend cannot split it into; warn of
    sequences past a per-batch RoPE switch. `generator.engine=auto` is not refused here:
    it falls back to the HF engine (trainer/build.py::generation_engine_name). A load-balancing loss for a
    model without a router is refused here too, before the weights load."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    policy = cfg.policy
    check_aux_loss(hf_config, policy.router_aux_loss_coef)
    if policy.backend == "megatron":
        check_megatron_core()
        reason = megatron_refusal(hf_config, policy.tensor_model_parallel_size, policy.pipeline_model_parallel_size,
                                  policy.sequence_parallel, launched_world_size())
        if reason is None:
            from aligner_ext.models.megatron.parallel import expert_parallel_refusal

            reason = expert_parallel_refusal(hf_config, policy, launched_world_size())
        if reason is None and policy.lora.rank > 0 and architecture(hf_config).experts is not None:
            reason = (f"{family_label(hf_config)}: policy.lora.rank={policy.lora.rank}: the Megatron backend's "
                      f"adapters do not cover mixture-of-experts layers yet; {HF_RUNS_IT}")
        if reason:
            raise UnsupportedModel(reason)
    check_engine(cfg.generator.engine, hf_config)
    warning = long_context_warning(hf_config, cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    if warning and is_main_process():  # every rank reads the same config: one line, not one per rank
        logger.warning(warning)


def check_routing_replay(cfg, hf_config, engine: str) -> None:
    """Refuse (ConfigError, one line) `policy.routing_replay` where there is nothing to replay: a dense
    model, an `engine` (generator.engine, auto resolved) that records no routing, or the graded system
    prompt, whose policy trains on another prompt than the engine generated from. Both policy backends
    replay, the Megatron backend under any layout (models/megatron/moe.py)."""
    if not cfg.policy.routing_replay:
        return
    if not is_moe(hf_config):
        raise ConfigError(f"policy.routing_replay=true: the model {family_label(hf_config)} has no router; routing "
                          "replay is for mixture-of-experts models")
    if engine != "rollout":
        named = f"auto (the {engine} engine here)" if cfg.generator.engine == "auto" else engine
        raise ConfigError(f"policy.routing_replay=true replays the experts the rollout engine records; "
                          f"generator.engine={named} records none: set generator.engine=rollout")
    if "graded_prompt" in active_variants(cfg) and not cfg.graded_prompt.keep_in_training:
        raise ConfigError("policy.routing_replay=true with the graded system prompt: the engine generates from "
                          "per-sample system prompts the policy does not train on, so its experts are those of "
                          "other tokens; set graded_prompt.keep_in_training=true or policy.routing_replay=false")
