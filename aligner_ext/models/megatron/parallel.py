"""Process groups for the Megatron backend: torch.distributed from the torchrun environment, then
megatron-core's tensor / pipeline / data-parallel groups.

One process per GPU (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); NCCL on
GPUs, gloo on CPU (with `cpu_shims`); the process group itself comes from `aligner_ext.distributed.init_from_env`,
which the training loop calls first. Without torchrun variables a single-process world is created
on a free local port, so conversion tools and single-process tests use the same code path.
Data-parallel size = world size / (TP x PP), as megatron-core derives it. Expert parallelism (EP, a
mixture of experts' experts split over EP ranks) is laid over the data-parallel ranks, as megatron-core
lays it: the experts' data-parallel size is DP / EP.

torch frees no process group's resources (a gloo group keeps three threads and its sockets after
`destroy_process_group`), and collectives slow down as they pile up (measured on 2 CPU processes:
100 all-reduces 0.055 s with no other group, 1.04 s beside 1,500 idle ones). So groups are made once
per process and layout: `init_model_parallel` keeps megatron-core's groups for every layout it has
made (a switch back to an earlier layout restores its groups instead of making them anew: a test
resuming checkpoints at alternating layouts made ~1,600 groups and crawled), and `partition_group`
returns the same group for the same partition of the ranks.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from aligner_ext.distributed import free_port, init_from_env
from aligner_ext.models.megatron.cpu_shims import apply_cpu_shims


def init_distributed() -> torch.device:
    """Initialise torch.distributed once (torchrun variables, else a world of one); return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        apply_cpu_shims()
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ:
        init_from_env()  # the trainer may have created it already (aligner_ext/distributed.py)
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return device


def init_model_parallel(tensor_parallel: int, pipeline_parallel: int, seed: int = 0, expert_parallel: int = 1) -> None:
    """megatron-core's model-parallel groups for a TP x PP layout, created unless this layout's are
    there (module docstring); the rest of the world is DP, over which the experts are split in
    `expert_parallel` parts (EP)."""
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    world = dist.get_world_size()
    if tensor_parallel < 1 or pipeline_parallel < 1 or world % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"policy.tensor_model_parallel_size={tensor_parallel} x pipeline_model_parallel_size="
            f"{pipeline_parallel} must be >= 1 and divide the world size {world}"
        )
    data_parallel = world // (tensor_parallel * pipeline_parallel)
    if expert_parallel < 1 or data_parallel % expert_parallel:
        raise ValueError(f"policy.expert_model_parallel_size={expert_parallel} must divide the data-parallel size "
                         f"{data_parallel} (world size {world} / TP {tensor_parallel} / PP {pipeline_parallel})")
    layout = (dist.group.WORLD, tensor_parallel, pipeline_parallel, expert_parallel)
    if not parallel_state.model_parallel_is_initialized():
        _LAYOUT_STATES.setdefault(None, _parallel_state(parallel_state))  # megatron-core's state before any layout
    else:
        current = (dist.group.WORLD, parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size())
        if current != layout and None in _LAYOUT_STATES:  # set aside, not destroyed: megatron-core's
            _LAYOUT_STATES[current] = _parallel_state(parallel_state)  # destroy frees some groups for good
            _set_parallel_state(parallel_state, _LAYOUT_STATES[None])
        elif current != layout:  # made by someone else: its groups cannot be set aside safely
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        if layout in _LAYOUT_STATES:
            _set_parallel_state(parallel_state, _LAYOUT_STATES[layout])
        else:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
                expert_model_parallel_size=expert_parallel,
            )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        mcore_tp.model_parallel_cuda_manual_seed(seed)


# (world group, TP, PP, EP) -> megatron-core's parallel_state globals of that layout; None -> before any
_LAYOUT_STATES: dict = {}


def _parallel_state(module) -> dict:
    """The module-level state of megatron-core's `parallel_state` (its groups, ranks and sizes: the
    upper-case globals `destroy_model_parallel` resets), to restore a layout without new groups."""
    return {name: copy.copy(value) if isinstance(value, (dict, list, set)) else value  # filled in place later
            for name, value in vars(module).items() if name.startswith("_") and name.isupper() and not callable(value)}


def _set_parallel_state(module, state: dict) -> None:
    for name, value in state.items():
        setattr(module, name, copy.copy(value) if isinstance(value, (dict, list, set)) else value)


_PARTITION_GROUPS: dict = {}  # (world group, partition, backend) -> this rank's group


def partition_group(parts: list[list[int]], backend: str | None = None):
    """This rank's group of a partition of the ranks into `parts`, created on first use (module
    docstring); a collective: every rank calls it with the same partition, as torch creates every
    group on every rank, in the same order."""
    key = (dist.group.WORLD, tuple(sorted(tuple(sorted(part)) for part in parts)), backend)
    if key not in _PARTITION_GROUPS:
        mine = None
        for part in key[1]:
            group = dist.new_group(list(part), backend=backend)
            if dist.get_rank() in part:
                mine = group
        _PARTITION_GROUPS[key] = mine
    return _PARTITION_GROUPS[key]


def expert_parallel_refusal(hf_config, cfg, world: int) -> str | None:
    """Why the Megatron backend does not run `policy.expert_model_parallel_size` (EP) for this model and
    layout, in one line, or None: EP splits a mixture of experts' experts over data-parallel ranks, so
    it must divide the expert count and DP = world / (TP x PP); its ranks run micro-batches in lockstep
    (policy.py's docstring), which `micro_batch_tokens` does not."""
    from aligner_ext.architecture import architecture

    ep = cfg.expert_model_parallel_size
    if ep == 1:
        return None
    experts = architecture(hf_config).experts
    if experts is None:
        return (f"policy.expert_model_parallel_size={ep} splits a mixture of experts' experts; "
                f"{hf_config.model_type} is a dense model: policy.expert_model_parallel_size=1 runs it")
    if experts.count % ep:
        return f"policy.expert_model_parallel_size={ep} does not divide the {experts.count} experts of {hf_config.model_type}"
    model_parallel = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    if world % model_parallel or (world // model_parallel) % ep:
        return (f"policy.expert_model_parallel_size={ep} does not divide the data-parallel size of {world} processes "
                f"/ (tensor_model_parallel_size={cfg.tensor_model_parallel_size} x pipeline_model_parallel_size="
                f"{cfg.pipeline_model_parallel_size})")
    if cfg.micro_batch_tokens > 0:
        return (f"policy.expert_model_parallel_size={ep} runs micro-batches of rows in lockstep over its ranks: "
                "policy.micro_batch_tokens=0 (rows per micro-batch, policy.micro_batch_size)")
    return None
