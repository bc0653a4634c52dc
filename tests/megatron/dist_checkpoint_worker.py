"""Runs under `torchrun --nproc_per_node=2` (gloo, CPU), launched by test_dist_checkpoint.py.

For each case (an HF checkpoint + `train_setup.pt` under the work directory) and each saving layout
(TP=2, PP=2; a mixture of experts: EP=2, its experts split over the two DP ranks, and DP=2 at EP=1):
a `MegatronPolicy` trains 2 steps, writes its distributed checkpoint (`save_sharded`), then trains a
third step ("straight"). For each of the other layouts with two processes (TP=2, PP=2, DP=2; a
mixture of experts: `MOE_LOADS`), a fresh policy built from the *starting* weights loads that
checkpoint (`load_sharded` + `load_state_dict`) and trains the same third step ("resumed").
Everything is gathered over all ranks into HF names with `convert.megatron_to_hf`, independently
of the checkpoint code: weights, Adam's exp_avg / exp_avg_sq and step. Rank 0 writes
`<case>/results.pt`; the test compares.

The first case also saves the same state in the background (megatron-core's asynchronous save,
`save_sharded(background=True)`) into `ckpt_<layout>_async` before the third step, its forked writer
held at a gate (a FIFO it opens for reading, which blocks until this process opens it for writing):
the third step trains while the write cannot have finished, `finished(wait=False)` says so on every
rank, then the gate opens and `finished(wait=True)` completes it. The test compares its files with
the synchronous checkpoint's. It saves its weights alone too, after the third step at TP=2
(`save_optimizer=false`), loaded at DP=2 by a fresh policy that then trains a step from a fresh optimizer.
"""

import os

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM

from aligner_ext.losses.clipped_pg import ClippedPGLoss
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from aligner_ext.models.megatron import convert
from aligner_ext.models.megatron.parallel import init_distributed
from aligner_ext.models.megatron.policy import MegatronPolicy

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 1), "ep2": (1, 1, 2)}  # (TP, PP, EP) on two processes
SAVED_AT = ("tp2", "pp2")
# a mixture of experts: saved with its experts split over the DP ranks, loaded with them whole, and back
MOE_LOADS = {"ep2": ("pp2", "dp2"), "dp2": ("ep2",)}
ADAM = ("exp_avg", "exp_avg_sq")


def build_policy(case: Path, layout: str) -> MegatronPolicy:
    setup = torch.load(case / "train_setup.pt", weights_only=False)
    tp, pp, ep = LAYOUTS[layout]
    cfg = dataclasses.replace(setup["policy_cfg"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
    return MegatronPolicy(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32), cfg, total_steps=8)


def train_step(policy: MegatronPolicy, case: Path) -> None:
    """One RL step on the case's batch, old log-probs offset from the current ones so the PPO clip fires."""
    setup = torch.load(case / "train_setup.pt", weights_only=False)
    batch = setup["batch"]
    logprobs, _ = policy.logprobs(batch, 1.0)
    batch.old_logprobs = logprobs + setup["old_offset"]
    policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)


def gathered(policy: MegatronPolicy) -> dict:
    """Weights, Adam state and step of the whole model in HF names (no Adam state before the first
    update), and the tied output copy (PP > 1)."""
    state = {}
    for inner in policy.optimizer.chained_optimizers:
        state.update(inner.optimizer.state)
    params = dict(policy.core.named_parameters())
    adam = ADAM if state else ()
    local = {"weight": {name: p.detach().clone() for name, p in params.items()}}
    for key in adam:
        local[key] = {name: state[p][key].clone() for name, p in params.items()}
    steps = {float(state[p]["step"]) for p in params.values()} if state else set()
    key = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep > 1:  # each EP rank holds its own experts
        key += (parallel_state.get_expert_model_parallel_rank(),)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (key, local, steps))
    shards = {k: v for k, v, _ in everyone}  # DP replicas overwrite each other
    tp, pp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    result = {field: convert.megatron_to_hf({k: shard[field] for k, shard in shards.items()}, policy.hf_config, tp, pp,
                                            ep) for field in ("weight", *adam)}
    result["steps"] = set().union(*(s for _, _, s in everyone))
    if policy.hf_config.tie_word_embeddings and pp > 1:  # the last stage's copy of the embedding
        vocab = policy.hf_config.vocab_size
        result["tied_copy"] = {field: torch.cat([shards[(pp - 1, r)][field]["output_layer.weight"]
                                                 for r in range(tp)])[:vocab] for field in ("weight", *adam)}
    return result


def gate(directory: Path) -> Path:
    return directory / f"gate_{dist.get_rank()}"


def in_background(policy: MegatronPolicy, directory: Path):
    """`save_sharded(directory, background=True)` with this rank's forked writer waiting at its gate."""
    if dist.get_rank() == 0:
        directory.mkdir()
    dist.barrier()
    os.mkfifo(gate(directory))
    real = FileSystemWriterAsync.write_preloaded_data_multithread

    def gated(*args, **kwargs):  # runs in the forked writer process
        with open(gate(directory), "rb") as handle:  # blocks until the trainer opens the gate
            handle.read()
        real(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(gated)
    try:
        return policy.save_sharded(directory, background=True)
    finally:
        FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(real)


def open_gate(background, directory: Path) -> None:
    """Let this rank's writer go on (opening the FIFO for writing waits for it to open it for reading)."""
    if background.calls.async_calls[0].async_caller.process is not None:  # a rank with nothing to write forks none
        with open(gate(directory), "wb"):
            pass
    os.unlink(gate(directory))


def weights_only(policy: MegatronPolicy, case: Path) -> dict:
    """The policy's weights saved without the optimizer (`trainer.save_optimizer=false`) and loaded at DP=2
    into a fresh policy (whose optimizer stays fresh), which then trains a step."""
    directory = case / "ckpt_weights_only"
    if dist.get_rank() == 0:
        directory.mkdir()
    dist.barrier()
    policy.save_sharded(directory, optimizer=False)
    fresh = build_policy(case, "dp2")
    fresh.load_sharded(directory, optimizer=False)
    loaded = gathered(fresh)
    train_step(fresh, case)
    return {"loaded": loaded, "trained": gathered(fresh)}


def run_case(case: Path, loads: dict[str, tuple[str, ...]], async_too: bool = False) -> dict:
    """For each saving layout of `loads`, its run and the runs resumed at each layout it names."""
    results = {}
    for saved_at, loaded_ats in loads.items():
        directory = case / f"ckpt_{saved_at}"
        if dist.get_rank() == 0:
            directory.mkdir()
        dist.barrier()
        policy = build_policy(case, saved_at)
        for _ in range(2):
            train_step(policy, case)
        policy.save_sharded(directory)
        state = policy.state_dict()
        results[saved_at] = {"saved": gathered(policy), "state": state}
        background = in_background(policy, case / f"ckpt_{saved_at}_async") if async_too else None
        train_step(policy, case)
        if background is not None:
            results[saved_at]["async_done_after_a_step"] = background.finished(wait=False)
            open_gate(background, case / f"ckpt_{saved_at}_async")
            results[saved_at]["async_done"] = background.finished(wait=True)
        results[saved_at]["straight"] = gathered(policy)
        if async_too and saved_at == "tp2":
            results[saved_at]["weights_only"] = weights_only(policy, case)
        for loaded_at in loaded_ats:
            policy = build_policy(case, loaded_at)
            policy.load_sharded(directory)
            policy.load_state_dict(state)
            loaded = gathered(policy)
            train_step(policy, case)
            results[saved_at][loaded_at] = {"loaded": loaded, "resumed": gathered(policy)}
    return results


def policy_config(case: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(case)


def main() -> None:
    torch.set_num_threads(1)
    init_distributed()
    root = Path(sys.argv[1])
    first = (root / "cases.txt").read_text().split()[0]
    for name in (root / "cases.txt").read_text().split():
        experts = getattr(policy_config(root / name), "num_experts", None)
        loads = MOE_LOADS if experts else {saved: tuple(at for at in ("tp2", "pp2", "dp2") if at != saved)
                                           for saved in SAVED_AT}
        results = run_case(root / name, loads, async_too=name == first)
        if dist.get_rank() == 0:
            torch.save(results, root / name / "results.pt")
    policy = build_policy(root / name, "tp2")
    try:
        policy.load_sharded(root / name)  # a directory without a `megatron/` checkpoint
    except FileNotFoundError as err:
        if dist.get_rank() == 0:
            torch.save(str(err), root / "missing_error.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
