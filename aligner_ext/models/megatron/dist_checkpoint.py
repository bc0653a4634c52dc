"""The Megatron backend's weights and optimizer state in megatron-core's distributed checkpoint format
(`megatron.core.dist_checkpointing`, torch_dist backend), so a run resumes at another TP / PP / DP
layout.

Every tensor is saved as its part of one *global* tensor (`ShardedTensor`: key, global shape, this
rank's offset, and a replica id so that one copy is written), and loading asks for the parts the
new layout needs. The global tensors do not depend on TP or PP:
- linear layers are split along the axis megatron-core splits them (fused QKV in its per-group
  order along the rows, o_proj and down_proj along the columns); `linear_fc1` (SwiGLU) is saved as
  its gate and up halves, so the per-rank [gate rows; up rows] layout reshards correctly;
- layers are stacked along a leading axis at their global number, so PP only moves offsets;
- the vocabulary is padded to a multiple of 128 whatever TP is (model.py), so embedding and output
  layer keep one global shape;
- `model.RMSNorm` (every norm, post-norms included) is saved replicated over TP and DP, which it is
  (megatron-core's default for a plain module); OLMo's q/k norms over the projection
  (`model.ProjectionRMSNorm`) along their rows over TP, like the heads they normalise, so the global
  tensor is HF's at any TP; `SDPAttention` has no state;
- tied embeddings with PP > 1: the last stage's copy of the embedding is saved under the
  embedding's key as a replica (megatron-core's `LanguageModule`), so it loads from the first
  stage's at any PP, and at PP = 1 the copy does not exist.

Optimizer state follows the parameter it belongs to (`optimizer.state.exp_avg.<parameter key>`,
...), through `optimizer.sharded_state_dict(model_sharded_state_dict)`: the plain optimizer maps
its per-parameter state directly; the distributed optimizer (state sharded over DP) uses the
'fully_reshardable' format, which gathers each parameter's state on save and slices it on load,
so it too reshards over TP, PP and DP. (megatron-core's default, 'fully_sharded_model_space', could not
be saved in 0.16: it produces flattened ShardedTensors, which 0.16's ShardedTensor refuses.) The
plain and the distributed optimizer write different keys (float32 master weights: none under float32
training, `optimizer.state.fp32_param.*` from the plain bf16 optimizer, `optimizer.state.param.*`
from the distributed one), so switching `use_distributed_optimizer` between save and resume is
refused by the strict load, the keys named (read from megatron-core 0.16's code, not run).

Loading into a distributed optimizer that has not stepped yet: with torch's Adam (no Transformer
Engine or Apex) its `state_dict` needs Adam's per-parameter state to exist, so `load` first takes a
zero-gradient step on its float32 shards, as megatron-core does before loading its FSDP format
(`_init_optimizer_states_with_dummy_values`); everything that step touches (Adam's moments and step,
the master weights) is then overwritten from the checkpoint, and the model's weights are not touched.
megatron-core cannot load 'fully_reshardable' state into torch's Adam either (0.16, and 0.19, whose
`load_parameter_state_from_fully_reshardable` is unchanged): it restores
Adam's step into every parameter's state, then copies the checkpoint's tensors into *every* key of
that state, 'step' included, which the checkpoint keeps apart (KeyError 'step', seen on 2x H200).
`_load_distributed` therefore sets the step aside while the tensors load and puts it back after.
It also hands every parameter its own copy of the step: megatron-core gives them all one shared step
tensor, and torch's Adam increments a step tensor once per parameter holding it, so after a resume
the step count grew by the number of parameters per update and Adam's bias correction went wrong
(a run resumed at step 15 of 30 drifted from the straight run from step 17 on, 2x H200).

With LoRA (`only=lora.is_adapter`) the checkpoint holds the adapters and their optimizer state
alone: the frozen base is the model the run loads (models/megatron/lora.py).

Every rank calls `save` and `load` (collectives inside). megatron-core 0.19 writes the non-tensor state
as the `common_state` item of the `.distcp` files; 0.16 wrote it into `common.pt`, which `load` still
reads, so a checkpoint written under 0.16 resumes (tests/megatron/test_checkpoint_from_0_16.py).

Nothing the directory holds is unpickled beyond tensors, numbers, strings and containers, so a
checkpoint handed over by someone else cannot run code on resume (docs/reliability.md). Left to
themselves, torch.distributed.checkpoint reads `.metadata` with `pickle.load`, and megatron-core's
`_extra_state` objects and its non-sharded state (bytes items of the `.distcp` files) with
`torch.load(weights_only=False)`. `load` therefore runs megatron-core's loader with
`SafeFileSystemReader` (`.metadata` through an unpickler allowing only `METADATA_GLOBALS`) and
`SafeLoadPlanner` (bytes items weights-only) swapped into its torch_dist strategy module, and its
reader of the non-sharded state replaced by `_load_common_state` (the same two; `common.pt` read
weights-only explicitly: torch's default yields to TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD); the tensors
themselves DCP already reads weights-only.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import traceback
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer import distrib_optimizer as mcore_distrib_optimizer
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from aligner_ext.errors import CheckpointError, UnsafeCheckpoint, error_line

DIRECTORY = "megatron"  # the subdirectory of a trainer checkpoint (trainer/checkpoint.py) holding it
RUN_SETTINGS = ("max_lr", "min_lr", "start_wd", "end_wd")  # parameter-group settings a resume may change
OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",  # reshards over TP, PP and DP (see above)
    "chained_optim_avoid_prefix": True,  # the same keys whether megatron-core chains optimizers or not
}


# Every global a `.metadata` of torch 2.13 / megatron-core 0.16 and 0.19 pickles (read from the files they write),
# plus torch's dtypes (`_allowed`): the metadata's dataclasses and enums, no function that runs anything.
METADATA_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("pathlib", "PosixPath"),  # the checkpoint id torch's own writer records
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
})


def _allowed(module: str, name: str) -> bool:
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    return (module, name) in METADATA_GLOBALS


class _MetadataUnpickler(pickle.Unpickler):
    """Refuses every global outside `METADATA_GLOBALS` (and torch's dtypes) before it is looked up."""

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader with `.metadata` read by `_MetadataUnpickler`, once (megatron-core reads it repeatedly)."""

    def read_metadata(self, *args, **kwargs):
        if getattr(self, "_safe_metadata", None) is None:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as handle:
                try:
                    metadata = _MetadataUnpickler(handle).load()
                except pickle.UnpicklingError as err:
                    raise _refusal(Path(path), err) from err
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._safe_metadata = metadata
        return self._safe_metadata


class SafeLoadPlanner(mcore_torch_strategy.MCoreLoadPlanner):
    """megatron-core's load planner with bytes items (`_extra_state`) unpickled weights-only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _load_common_state(checkpoint_dir) -> dict:
    """megatron-core's non-sharded state, read weights-only whatever the environment says: the
    `common_state` item of the `.distcp` files, or `common.pt` in a checkpoint written by megatron-core 0.16."""
    legacy = Path(checkpoint_dir) / COMMON_STATE_FNAME
    if legacy.exists():
        try:
            return torch.load(legacy, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refusal(legacy, err) from err
    reader = SafeFileSystemReader(checkpoint_dir)
    reader.read_metadata()  # refused here: DCP's load takes a failed read for a missing file and looks for another
    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    state = {key: io.BytesIO()}
    torch.distributed.checkpoint.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state[key][0]


def _refusal(path: Path, err: BaseException) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{path}: refusing to load it, it holds objects other than tensors, numbers, strings "
                            f"and containers (loading them could run code): {error_line(err)}")


@contextlib.contextmanager
def _safe_readers() -> Iterator[None]:
    """Swap the safe reader and planner into megatron-core's torch_dist strategy module, which looks both
    up by name when it loads (`_get_filesystem_reader`, `MCoreLoadPlanner`), and the safe reader of the
    non-sharded state into its `serialization` module (`load_common_state_dict`)."""
    saved = (mcore_torch_strategy._get_filesystem_reader, mcore_torch_strategy.MCoreLoadPlanner,
             serialization.load_common_state_dict)
    mcore_torch_strategy._get_filesystem_reader = lambda checkpoint_dir, **_: SafeFileSystemReader(checkpoint_dir)
    mcore_torch_strategy.MCoreLoadPlanner = SafeLoadPlanner
    serialization.load_common_state_dict = _load_common_state
    try:
        yield
    finally:
        (mcore_torch_strategy._get_filesystem_reader, mcore_torch_strategy.MCoreLoadPlanner,
         serialization.load_common_state_dict) = saved


@contextlib.contextmanager
def _groups_paired_without_run_settings() -> Iterator[None]:
    """megatron-core 0.19 pairs each saved parameter group with the current one of the same identifier
    (`param_group_identifier_keys`, looked up by both optimizer modules when they load), the learning rate
    and weight decay among them, so a resume at another learning rate found no group. The run applies its
    own after the load (`optimizer.apply_settings`, `set_lr`): the groups are paired without them."""
    modules = (mcore_optimizer, mcore_distrib_optimizer)
    saved = [module.param_group_identifier_keys for module in modules]
    for module, keys in zip(modules, saved):
        module.param_group_identifier_keys = tuple(key for key in keys if key not in RUN_SETTINGS)
    try:
        yield
    finally:
        for module, keys in zip(modules, saved):
            module.param_group_identifier_keys = keys


def _raise_refusal_from(err: CheckpointException, directory: Path) -> None:
    """DCP gathers each rank's exception into one CheckpointException: raise a refusal found among them."""
    for cause, _traceback in err.failures.values():
        if isinstance(cause, CheckpointError):
            raise cause from err
        if isinstance(cause, pickle.UnpicklingError):  # a tensor item, read weights-only by DCP itself
            raise _refusal(directory, cause) from err


def sharded_state_dict(model: torch.nn.Module, optimizer, is_loading: bool,
                       only: Callable[[str], bool] | None = None) -> dict:
    """The model's and the optimizer's sharded state dicts (the optimizer's keyed by the model's; none
    when `optimizer` is None: a weights-only checkpoint); `only`: the model's entries whose key it admits."""
    model_state = model.sharded_state_dict()
    if only is not None:
        model_state = {key: value for key, value in model_state.items() if only(key)}
    if optimizer is None:
        return {"model": model_state}
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)}


def save(directory: Path, model: torch.nn.Module, optimizer, only: Callable[[str], bool] | None = None,
         background: bool = False) -> AsyncSave | None:
    """Write `model` (this rank's GPTModel; `only`: the parameters it admits) and `optimizer` (None: the
    weights alone) into `directory`, which must not exist yet; `background`: megatron-core's
    asynchronous save (`AsyncSave`)."""
    if dist.get_rank() == 0:
        directory.mkdir()
    dist.barrier()
    try:
        request = dist_checkpointing.save(sharded_state_dict(model, optimizer, is_loading=False, only=only),
                                          str(directory), async_sharded_save=background,
                                          async_strategy="mcore")
    except BaseException as err:
        if dist.get_rank() == 0:
            _release_waiting_ranks(err)
        raise
    return AsyncSave(request) if background else None


class AsyncSave:
    """megatron-core's asynchronous save of one distributed checkpoint.

    When it starts, each rank copies its shards to host memory (on the CPU the fork below snapshots
    them) and forks a process that writes its `.distcp` files: megatron-core's own strategy
    (`async_strategy="mcore"`; 0.19's default, "nvrx", needs nvidia-resiliency-ext) with its default
    `TemporalAsyncCaller` (its persistent caller would hand CPU tensors to its worker through shared
    memory, not as a snapshot). `finished` asks every rank whether its process is done (an all-reduce) and then
    finalises: rank 0 writes `.metadata` and `metadata.json`, as the synchronous save does."""

    def __init__(self, request):
        self.calls = AsyncCallsQueue(persistent=False)
        self.calls.schedule_async_request(request)

    def finished(self, wait: bool) -> bool:
        """Whether every rank's part is written and the checkpoint finalised (collective)."""
        try:
            self.calls.maybe_finalize_async_calls(blocking=wait)
        except BaseException as err:
            if dist.get_rank() == 0:
                _release_waiting_ranks(err, finalising=self.calls.call_idx)
            raise
        return self.calls.get_num_unfinalized_calls() == 0


def _release_waiting_ranks(err: BaseException, finalising: int | None = None) -> None:
    """Join the collectives the other ranks wait in when writing the metadata failed on rank 0 alone.

    megatron-core 0.16 writes `.metadata` (`save_state_dict_async_finalize`) and `metadata.json`
    (`metadata_finalize_fn`) on rank 0 while the other ranks already wait: in the broadcast of the
    failure status after `.metadata`, in a barrier after `metadata.json` (and, finalising the
    asynchronous save numbered `finalising`, in the all-reduce of that number after it). A failed
    write there (a disk that filled with the `.distcp` files) raises on rank 0 only, and every rank
    would hang in mismatched collectives. Broadcasting the failure makes the other ranks raise
    megatron-core's CheckpointException too; joining the barrier lets them return (the checkpointer
    then tells every rank of rank 0's failure). Failures megatron-core reports itself arrive on every
    rank and need nothing."""
    stages = {frame.name for frame in traceback.extract_tb(err.__traceback__)}
    if "save_state_dict_async_finalize" in stages and not isinstance(err, CheckpointException):
        failed = torch.tensor([1], dtype=torch.int, device=torch.cuda.current_device())
        dist.broadcast(failed, src=0)
    elif "metadata_finalize_fn" in stages:
        dist.barrier()
        if finalising is not None:
            number = torch.tensor([finalising], dtype=torch.int, device=torch.cuda.current_device())
            dist.all_reduce(number, op=dist.ReduceOp.MAX)


def load(directory: Path, model: torch.nn.Module, optimizer, only: Callable[[str], bool] | None = None) -> None:
    """Load what `save` wrote, at this run's layout, into `model` and `optimizer` (None: a weights-only
    checkpoint, which holds the weights alone)."""
    try:
        found = dist_checkpointing.check_is_distributed_checkpoint(str(directory))
    except ValueError as err:  # megatron-core's metadata.json is not JSON
        raise CheckpointError(f"{directory / 'metadata.json'}: unreadable ({error_line(err)})") from err
    if not found:
        raise FileNotFoundError(f"{directory} is not a megatron-core distributed checkpoint "
                                "(a checkpoint of another policy backend?)")
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []:
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()  # see the module docstring
    try:
        with _safe_readers():
            wanted = sharded_state_dict(model, optimizer, is_loading=True, only=only)
            state = dist_checkpointing.load(wanted, str(directory), strict=StrictHandling.RAISE_ALL)
    except CheckpointException as err:
        _raise_refusal_from(err, directory)
        raise
    model.load_state_dict(state["model"], strict=only is None)
    if optimizer is None:
        return
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    with _groups_paired_without_run_settings():
        if len(inner) == 1 and isinstance(inner[0], DistributedOptimizer):
            _load_distributed(inner[0], state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])


def _load_distributed(optimizer: DistributedOptimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)` with torch Adam's per-parameter step set aside (module docstring)."""
    param_state = state.pop("param_state")
    if state.pop("param_state_sharding_type") != OPTIMIZER_METADATA["distrib_optim_sharding_type"]:
        raise ValueError("the checkpoint's distributed optimizer state is not in the fully_reshardable format")
    optimizer.load_state_dict(state)  # param groups, and Adam's step into each parameter's state
    steps = {param: entry.pop("step") for param, entry in optimizer.optimizer.state.items() if "step" in entry}
    optimizer.load_parameter_state_from_fully_reshardable(param_state)
    restore_steps(optimizer.optimizer, steps)


def restore_steps(torch_optimizer: torch.optim.Optimizer, steps: dict) -> None:
    """Put each parameter's Adam step back as a tensor of its own (module docstring)."""
    for param, step in steps.items():
        torch_optimizer.state[param]["step"] = step.clone()
