"""Runs under `torchrun --nproc_per_node=2` (gloo, CPU), launched by test_tp_pp.py.

For every (case, layout) line of `logprob_cases.txt` (a case: an HF checkpoint + `batch.pt` under
the work directory; a layout: tp{T}_pp{P}[_ep{E}][_sp][_packed], _ep2: a mixture of experts' experts
split over the 2 data-parallel ranks): build this rank's GPTModel from the HF
weights (convert.py), compute the response log-probs and entropy (forward.py), a zeroed HF model
refitted from it (weights.py), the norm megatron-core's gradient clipping takes, over the weights,
and (through megatron-core's DDP) the gradient of the sum of valid response log-probs, converted
back to HF names;
with micro-batches of padded rows, and (`_packed`) with the sequences packed end to end under a
token budget that puts rows 0 and 2 together and row 1 alone (out of order).
Rank 0 writes `<case>/tp{T}_pp{P}[_ep{E}][_sp][_packed].pt`; the test compares with HF. Launched with 4
processes it runs the mixtures of experts at TP=2 + SP x EP=2 alone (`four_ranks`).
"""

import dataclasses
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from aligner_ext.batch import ExperienceBatch
from aligner_ext.models.megatron import convert, forward, weights
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.megatron.optimizer import wrap_ddp
from aligner_ext.models.megatron.policy import MegatronPolicy
from aligner_ext.models.megatron.model import build_gpt_model, transformer_config
from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel
from aligner_ext.models.packing import token_micro_batches
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

MICRO_BATCH = 2
CHUNK = 3
TOKEN_BUDGET = 12  # rows of 7, 6 and 5 tokens: [0, 2] and [1]


def micro_batches(batch: ExperienceBatch, device, multiple_of: int, packed: bool) -> tuple[list[forward.Packed], list[int]]:
    """The micro-batches and the batch rows they hold, in order."""
    if packed:
        groups = token_micro_batches(batch.attention_mask.sum(dim=1).tolist(), TOKEN_BUDGET)
        assert groups == [[0, 2], [1]]
        width = max(int(batch.select(g).attention_mask.sum()) for g in groups)  # equal shapes for PP
        return [forward.pack_sequences(batch.select(g), 0, device, multiple_of, width) for g in groups], [0, 2, 1]
    parts = [batch.select(list(range(start, min(len(batch), start + MICRO_BATCH))))
             for start in range(0, len(batch), MICRO_BATCH)]
    return [forward.pack(forward.pad_rows(part, MICRO_BATCH), 0, device, multiple_of) for part in parts], [0, 1, 2]


def gathered_shards(shard: dict, ep: int = 1) -> dict:
    """Every rank's shard keyed by (stage, tensor rank[, EP rank at ep > 1]), on every rank."""
    key = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    if ep > 1:
        key += (parallel_state.get_expert_model_parallel_rank(),)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (key, shard))
    return dict(everything)


def run_case(case: Path, tp: int, pp: int, sp: bool, packed: bool, device, ep: int = 1) -> None:
    hf_config = AutoConfig.from_pretrained(case)
    hf_state = convert.stacked_experts(load_file(case / "model.safetensors"))
    tensors = torch.load(case / "batch.pt")
    mask = tensors["response_valid"]
    batch = ExperienceBatch(samples=[None] * len(mask), response_mask=mask, group_ids=torch.arange(len(mask)), **tensors)
    init_model_parallel(tp, pp, expert_parallel=ep)
    model = build_gpt_model(hf_config, transformer_config(hf_config, tp, pp, torch.float32, sp, expert_parallel=ep),
                            device)
    stage, rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    convert.load_shard(model, convert.hf_to_megatron_shard(hf_state, hf_config, tp, pp, rank, stage, ep,
                                                           parallel_state.get_expert_model_parallel_rank()))
    micro, rows = micro_batches(batch, device, tp if sp else 1, packed)
    lp, ent = forward.forward_logprobs(model, micro, hf_config.vocab_size, CHUNK, 1.0)
    order = torch.tensor(rows).argsort()  # back to the batch's row order
    result = {"logprobs": lp[order], "entropy": ent[order], "refit": refit_into_zeros(model, hf_config),
              "counted_weight_norm": counted_weight_norm(model)}
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    ddp.zero_grad_buffer()
    forward.forward_backward(ddp, micro, hf_config.vocab_size, CHUNK, 1.0,
                             lambda lp, micro: ((lp * micro.response_valid).sum(), {}))
    replicas = parallel_state.get_data_parallel_world_size()  # each DP rank ran the whole batch, DDP sums them
    grads = gathered_shards({name: p.main_grad.detach() / replicas for name, p in model.named_parameters()}, ep)
    result["grads"] = convert.megatron_to_hf(grads, hf_config, tp, pp, ep)
    if dist.get_rank() == 0:
        torch.save(result, case / layout_name(tp, pp, sp, packed=packed, ep=ep))


def counted_weight_norm(model) -> float:
    """The L2 norm megatron-core's gradient clipping would compute, over the weights instead of the
    gradients: the parameters it counts (not a tied copy, not a TP replica beyond rank 0 unless
    marked TP-sharded), reduced over the model-parallel group."""
    counted = [p for p in model.parameters() if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    # megatron-core's optimizer takes the experts' norm (`allreduce=False`) over their own model-parallel
    # group (expert TP x EP x PP) and the rest over the model-parallel group, then their root sum of squares
    dense = [p.detach() for p in counted if getattr(p, "allreduce", True)]
    experts = [p.detach() for p in counted if not getattr(p, "allreduce", True)]
    norm = float(get_grad_norm_fp32(dense, grad_stats_parallel_group=parallel_state.get_model_parallel_group()))
    if experts:
        expert_norm = float(get_grad_norm_fp32(
            experts, grad_stats_parallel_group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()))
        norm = (norm ** 2 + expert_norm ** 2) ** 0.5
    return norm


def refit_into_zeros(model, hf_config) -> dict:
    """An HF model with every parameter zeroed, after `weights.refit_hf_model` from this rank's GPTModel."""
    target = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for param in target.parameters():
            param.zero_()
    weights.refit_hf_model(model, target, hf_config)
    return target.state_dict()


def parse_layout(layout: str) -> tuple[int, int, bool, bool, int]:
    """tp{T}_pp{P}[_ep{E}][_sp][_packed] -> (T, P, sp, packed, E)."""
    tp, pp, ep, sp, packed = re.fullmatch(r"tp(\d)_pp(\d)(?:_ep(\d))?(_sp)?(_packed)?", layout).groups()
    return int(tp), int(pp), bool(sp), bool(packed), int(ep or 1)


def layout_name(tp: int, pp: int, sp: bool, prefix: str = "", packed: bool = False, ep: int = 1) -> str:
    return f"{prefix}tp{tp}_pp{pp}{f'_ep{ep}' if ep > 1 else ''}{'_sp' if sp else ''}{'_packed' if packed else ''}.pt"


def train_case(case: Path, tp: int, pp: int, sp: bool, packed: bool = False, ep: int = 1) -> None:
    """One train call; `packed`: micro-batches under a token budget, with activation recomputation."""
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32)
    setup = torch.load(case / "train_setup.pt", weights_only=False)
    cfg = dataclasses.replace(setup["policy_cfg"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sp, micro_batch_tokens=TOKEN_BUDGET if packed else 0,
                              recompute_activations=packed, expert_model_parallel_size=ep)
    policy = MegatronPolicy(model, cfg, total_steps=4)
    batch = setup["batch"]
    lp, ent = policy.logprobs(batch, 1.0)
    batch.old_logprobs = lp + setup["old_offset"]
    metrics = policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)
    new_lp, _ = policy.logprobs(batch, 1.0)
    policy.sync_weights()  # the HF copy compared below
    if dist.get_rank() == 0:
        state = {k: v.clone() for k, v in policy.model.state_dict().items()}
        torch.save({"logprobs": lp, "entropy": ent, "metrics": metrics, "new_logprobs": new_lp, "state": state},
                   case / layout_name(tp, pp, sp, "train_", packed, ep))


def on_policy_case(case: Path, tp: int, pp: int, sp: bool, packed: bool) -> None:
    """One update on a batch without old log-probs (the on-policy shortcut): the train call fills them
    and the entropy from its own forward."""
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32)
    setup = torch.load(case / "train_setup.pt", weights_only=False)
    cfg = dataclasses.replace(setup["policy_cfg"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sp, micro_batch_tokens=TOKEN_BUDGET if packed else 0,
                              mini_batch_size=0)
    policy = MegatronPolicy(model, cfg, total_steps=4)
    batch = setup["batch"]
    assert policy.fills_old_logprobs(len(batch))
    metrics = policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)
    policy.sync_weights()
    if dist.get_rank() == 0:
        state = {k: v.clone() for k, v in policy.model.state_dict().items()}
        torch.save({"old_logprobs": batch.old_logprobs, "entropy": batch.entropy, "metrics": metrics, "state": state},
                   case / layout_name(tp, pp, sp, "on_policy_", packed))


def guard_case(case: Path) -> None:
    """At TP=2: a batch that differs on rank 1 is refused."""
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32)
    setup = torch.load(case / "train_setup.pt", weights_only=False)
    policy = MegatronPolicy(model, dataclasses.replace(setup["policy_cfg"], tensor_model_parallel_size=2), total_steps=4)
    batch = setup["batch"]
    if dist.get_rank() == 1:
        batch = batch.select([0, 2, 1])
    errors = {}
    try:
        policy.logprobs(batch, 1.0)
    except RuntimeError as err:
        errors["batch"] = str(err)
    if dist.get_rank() == 0:
        torch.save(errors, case / "guards.pt")


def four_ranks(root: Path, device) -> None:
    """Under `torchrun --nproc_per_node=4`: the mixtures of experts at TP=2 with sequence parallelism and
    their experts split over the two DP ranks (EP=2), log-probs and one train call."""
    for name in ("qwen3_moe", "qwen2_moe"):
        run_case(root / name, 2, 1, True, False, device, ep=2)
    train_case(root / "qwen2_moe", 2, 1, True, ep=2)


def process_groups(run: tuple) -> tuple[int, int, int]:
    """(TP, PP, EP) of a run (name, tp, pp, sp, packed, ep): the layout its process groups depend on."""
    _, tp, pp, _, _, ep = run
    return tp, pp, ep


def main() -> None:
    torch.set_num_threads(1)
    device = init_distributed()
    root = Path(sys.argv[1])
    if dist.get_world_size() == 4:
        four_ranks(root, device)
        dist.barrier()
        dist.destroy_process_group()
        return
    # layout by layout, so megatron-core's groups are made once per layout (models/megatron/parallel.py)
    logprob_runs = [(name, *parse_layout(layout)) for name, layout in
                    map(str.split, (root / "logprob_cases.txt").read_text().splitlines())]
    for name, tp, pp, sp, packed, ep in sorted(logprob_runs, key=process_groups):
        run_case(root / name, tp, pp, sp, packed, device, ep)
    train_runs = []
    for name in (root / "train_cases.txt").read_text().split():
        experts = getattr(AutoConfig.from_pretrained(root / name), "num_experts", None)
        for tp, pp, sp in ((2, 1, False), (1, 2, False), (1, 1, False), (2, 1, True)):  # (1, 1): DP=2
            if not (experts and tp > 1 and not sp):  # a mixture of experts under TP needs SP
                train_runs.append((name, tp, pp, sp, False, 1))
        train_runs += [(name, tp, pp, sp, True, 1) for tp, pp, sp in ((2, 1, True), (1, 2, False), (1, 1, False))]
        if experts:  # the experts split over the two data-parallel ranks (EP=2)
            train_runs.append((name, 1, 1, False, False, 2))
    for name, tp, pp, sp, packed, ep in sorted(train_runs, key=process_groups):
        train_case(root / name, tp, pp, sp, packed, ep)
    for tp, pp, sp, packed in ((2, 1, True, True), (1, 2, False, True), (1, 1, False, False)):
        on_policy_case(root / "llama", tp, pp, sp, packed)
    guard_case(root / "llama")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
