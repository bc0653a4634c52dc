"""Datasets in, tokenised prompt batches out: readers (parquet / jsonl), chat templating and padding,
the resumable prompt loader, and the built-in synthetic tasks."""

from aligner_ext.data.loader import DataConfig, PromptLoader, build_loader, build_val_loaders, load_split
from aligner_ext.data.readers import DataError, load_files, load_rows
from aligner_ext.data.tasks import TASKS, builtin_rows, sft_target
from aligner_ext.data.templating import encode_prompt, left_pad, right_pad
from aligner_ext.data.types import PromptDraw, PromptRow

__all__ = [
    "DataConfig", "DataError", "PromptDraw", "PromptLoader", "PromptRow", "TASKS", "build_loader",
    "build_val_loaders", "builtin_rows", "encode_prompt", "left_pad", "load_files", "load_rows", "load_split",
    "right_pad", "sft_target",
]
