"""LoRA's parts shared by both backends (docs/lora.md), and the HF backend's adapters through peft.

`attach` injects peft's LoRA layers into the transformers model in place and freezes every other
weight, so the optimizer holds the adapters only; the model keeps its class and its transformers
names (`model.layers.0.self_attn.q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`), and
the returned PeftModel wraps it for what peft does itself: switching the adapters off (the KL
reference, `AdaptersOff` in models/hf.py) and writing them in peft's format. The Megatron backend's
adapters are its own (models/megatron/lora.py) and use the rest: the target patterns, the base's
checksum, the peft-format writer and the refusals.

A checkpoint of adapters holds, in `base.json`, a pointer to the base they were trained on and its
checksum (SHA-256 over its weight files, in name order): resuming on another base is refused with one
line naming both (`check_base`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from aligner_ext.adapters import adapter_state
from aligner_ext.errors import CheckpointError, ConfigError
from aligner_ext.models.settings import LoraConfig

BASE_FILE = "base.json"  # in a checkpoint: the base model the adapters belong to
ADAPTER_DIR = "adapter"  # in the HF export: the adapters in peft's format, beside the merged model
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # weights as transformers saves them


def target_pattern(patterns: list[str]) -> re.Pattern:
    """One regular expression a layer's name must match in full: a name matching one of `patterns`
    in full, or whose last parts do (`q_proj` takes `model.layers.0.self_attn.q_proj`)."""
    return re.compile(r"(?:.*\.)?(?:" + "|".join(f"(?:{pattern})" for pattern in patterns) + ")")


def targets(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """The names of the linear layers of `model` that get an adapter (`target_pattern`)."""
    pattern = target_pattern(patterns)
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and pattern.fullmatch(name)]


class ProductInInputDtype(torch.nn.Linear):
    """An adapter matrix (peft's lora_A or lora_B) whose product runs in its input's dtype: the matrix
    stays in float32 for the optimizer, the activations of a bf16 model stay bf16. peft would instead
    copy every adapted layer's input to float32 and run both products and the sum on float32 CUDA
    cores, about a fifth of the training step at the 8B shape (docs/lora.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def attach(model: torch.nn.Module, cfg: LoraConfig):
    """Inject adapters of `cfg` into `model` in place; the PeftModel wrapping it. Adapters of a bf16 or
    fp16 model are kept in float32 (peft's default: their updates are small next to their values) and
    multiply in the model's dtype (`ProductInInputDtype`)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = targets(model, cfg.target_modules)
    if not names:
        raise ConfigError(f"policy.lora.target_modules={cfg.target_modules} matches none of the model's linear "
                          f"layers (e.g. {', '.join(_some_linears(model))})")
    config = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=names,
                            init_lora_weights=True if cfg.init == "kaiming" else "gaussian", bias="none")
    peft_model = get_peft_model(model, config)
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = False  # peft's float32 copy of the input (class docstring)
            for matrix in (*module.lora_A.values(), *module.lora_B.values()):
                matrix.__class__ = ProductInInputDtype
    return peft_model


def _some_linears(model: torch.nn.Module) -> list[str]:
    """The distinct last parts of the model's linear layers' names, for a message."""
    parts = dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                          if isinstance(module, torch.nn.Linear))
    return list(parts)[:8]


def base_fingerprint(path: str) -> dict[str, str]:
    """{"path": the base model's directory (or hub id), "sha256": the checksum of its weight files}."""
    return {"path": path, "sha256": _weights_checksum(path)}


@functools.lru_cache(maxsize=4)
def _weights_checksum(path: str) -> str:
    """SHA-256 over the names and bytes of the weight files of the checkpoint directory `path` (a hub id:
    its cached snapshot); computed once per process."""
    directory = Path(path)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(path, local_files_only=True))
    digest = hashlib.sha256()
    for file in sorted(directory.iterdir()):
        if file.is_file() and file.name.endswith(WEIGHT_SUFFIXES):
            digest.update(file.name.encode())
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(block)
    return digest.hexdigest()


def write_base(base: str, directory: Path) -> None:
    """`base.json` in the checkpoint `directory`: the base model at `base` (a path or hub id)."""
    (directory / BASE_FILE).write_text(base_json(base), encoding="utf-8")


def base_json(base: str) -> str:
    """What `write_base` writes."""
    return json.dumps(base_fingerprint(base), indent=1)


def check_base(base: str, checkpoint: Path) -> None:
    """Refuse adapters of `checkpoint` trained on another base than this run's, loaded from `base`
    (CheckpointError, one line naming both)."""
    saved = json.loads((checkpoint / BASE_FILE).read_text(encoding="utf-8"))
    current = base_fingerprint(base)
    if saved["sha256"] != current["sha256"]:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds adapters of the base model {saved['path']} "
            f"(sha256 {saved['sha256'][:12]}), not of this run's {current['path']} "
            f"(sha256 {current['sha256'][:12]}); resume with that base "
            "(model.path) or start afresh (trainer.resume=false)")


def save_peft(state: dict[str, torch.Tensor], cfg: LoraConfig, base: str, directory: Path) -> None:
    """Adapters in peft's format (`adapter_config.json`, `adapter_model.safetensors`) from `state`,
    peft's names (`base_model.model.<module>.lora_A.weight`): what `PeftModel.from_pretrained` loads
    onto the base model at `base`."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    modules = sorted({name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for name in state})
    config = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=modules,
                            bias="none", base_model_name_or_path=base)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file({name: value.contiguous() for name, value in state.items()}, str(directory / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def load_adapters(model: torch.nn.Module, state: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Copy the checkpoint's adapter tensors into `model`'s; a checkpoint of other adapters (rank,
    targets) is a CheckpointError naming what differs."""
    expected = adapter_state(model)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {checkpoint} holds other adapters than policy.lora makes: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]} ({len(missing)} and {len(unexpected)})")
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise CheckpointError(f"checkpoint {checkpoint}: adapter {name} is {tuple(value.shape)}, policy.lora "
                                  f"makes {tuple(expected[name].shape)} (another policy.lora.rank?)")
    model.load_state_dict(state, strict=False)
