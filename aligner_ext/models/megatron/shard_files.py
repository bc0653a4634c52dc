"""Megatron checkpoint directories on disk, and the conversion command line
(`python scripts/convert_checkpoint.py hf-to-megatron|megatron-to-hf ...`).

A Megatron directory holds, for a TP x PP layout:
- `mp_rank_<TT>_<PPP>/model.safetensors`: the state dict of tensor rank TT on pipeline stage PPP
  (Megatron-LM's directory naming), in `convert.py`'s layout and the source's dtype;
- `megatron_layout.json`: {"tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP};
- `config.json`: the HF config the shards were made from (needed to convert back);
- every other file of the HF directory (tokenizer, generation config) copied unchanged.

Conversion only slices and concatenates (convert.py), so HF -> Megatron -> HF returns every tensor
bit for bit. Resharding to another layout goes through HF: `megatron-to-hf`, then `hf-to-megatron`
with the new TP / PP. An HF directory may hold one `model.safetensors` or an indexed set of shards
(`model.safetensors.index.json`); the HF output is written as one `model.safetensors`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from aligner_ext.models.megatron import convert

LAYOUT_FILE = "megatron_layout.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json", LAYOUT_FILE)


def shard_dir(directory: Path, tp_rank: int, stage: int) -> Path:
    return directory / f"mp_rank_{tp_rank:02d}_{stage:03d}"


def read_hf(directory: Path) -> tuple[dict[str, torch.Tensor], object]:
    """The full state dict and config of an HF checkpoint directory (safetensors only)."""
    config = AutoConfig.from_pretrained(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    return convert.stacked_experts(state), config


def _copy_other_files(source: Path, target: Path) -> None:
    """Tokenizer and the like: every plain file that is not a weight, config or layout file."""
    for path in source.iterdir():
        if path.is_file() and path.name not in WEIGHT_FILES and not path.name.endswith(".safetensors"):
            shutil.copy2(path, target / path.name)


def hf_to_megatron_dir(hf_dir: Path, out_dir: Path, tp: int, pp: int) -> None:
    """Write every (stage, tensor rank) shard of an HF checkpoint for a TP x PP layout."""
    state, config = read_hf(hf_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for (stage, rank), shard in convert.hf_to_megatron(state, config, tp, pp).items():
        shard_dir(out_dir, rank, stage).mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in shard.items()}, str(shard_dir(out_dir, rank, stage) / "model.safetensors"))
    config.save_pretrained(out_dir)
    layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    (out_dir / LAYOUT_FILE).write_text(json.dumps(layout, indent=2))
    _copy_other_files(hf_dir, out_dir)


def read_megatron(directory: Path) -> tuple[convert.Shards, object, int, int]:
    """The shards, HF config and (TP, PP) of a Megatron directory written by `hf_to_megatron_dir`."""
    layout_path = directory / LAYOUT_FILE
    if not layout_path.exists():
        raise FileNotFoundError(f"{directory} has no {LAYOUT_FILE}: not a directory written by hf-to-megatron")
    layout = json.loads(layout_path.read_text())
    tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    shards = {}
    for stage in range(pp):
        for rank in range(tp):
            path = shard_dir(directory, rank, stage) / "model.safetensors"
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing (layout TP={tp} x PP={pp})")
            shards[(stage, rank)] = load_file(str(path))
    return shards, AutoConfig.from_pretrained(directory), tp, pp


def megatron_to_hf_dir(megatron_dir: Path, out_dir: Path) -> None:
    """Write the HF checkpoint (one model.safetensors, config, other files) of a Megatron directory."""
    shards, config, tp, pp = read_megatron(megatron_dir)
    state = convert.per_expert(convert.megatron_to_hf(shards, config, tp, pp))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    _copy_other_files(megatron_dir, out_dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="HF directory -> per-(stage, rank) shards")
    to_megatron.add_argument("--hf", type=Path, required=True, help="HF checkpoint directory")
    to_megatron.add_argument("--out", type=Path, required=True, help="Megatron directory to write")
    to_megatron.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    to_megatron.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_hf = commands.add_parser("megatron-to-hf", help="per-(stage, rank) shards -> HF directory")
    to_hf.add_argument("--megatron", type=Path, required=True, help="Megatron directory (from hf-to-megatron)")
    to_hf.add_argument("--out", type=Path, required=True, help="HF checkpoint directory to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "hf-to-megatron":
        hf_to_megatron_dir(args.hf, args.out, args.tp, args.pp)
    else:
        megatron_to_hf_dir(args.megatron, args.out)
    return 0
