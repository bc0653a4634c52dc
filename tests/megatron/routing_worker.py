"""Runs under `torchrun --nproc_per_node=2` (gloo, CPU), launched by test_megatron_routing.py.

For each (case, layout) line of `routing_cases.txt` (a case: a mixture of experts' HF checkpoint with
`routing_setup.pt`; a layout as worker.py names it): the routing mismatch of the old-log-prob pass and
of an on-policy training forward, the router gradients with and without the load-balancing loss, and
log-probs, KL reference log-probs and router gradients under routing replay. Rank 0 writes
`<case>/routing_<layout>.pt`.
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from aligner_ext.batch import ExperienceBatch
from aligner_ext.models.megatron import convert
from aligner_ext.models.megatron.parallel import init_distributed
from aligner_ext.models.megatron.policy import MegatronPolicy
from probe_losses import SummedLogprobs
from worker import TOKEN_BUDGET, gathered_shards, layout_name, parse_layout


def router_grads(policy: MegatronPolicy, tp: int, pp: int, ep: int) -> dict:
    """The routers' gradients of the last update (summed over DP by DDP), under their HF names."""
    grads = gathered_shards({name: p.main_grad.detach().clone() for name, p in policy.core.named_parameters()}, ep)
    hf = convert.megatron_to_hf(grads, policy.hf_config, tp, pp, ep)
    return {name: grad for name, grad in hf.items() if name.endswith("mlp.gate.weight")}


def routing_case(case: Path, tp: int, pp: int, sp: bool, packed: bool = False, ep: int = 1) -> None:
    """A mixture of experts with the engine's routing (`routing_setup.pt`: a batch whose routing differs
    from the model's own at known pairs, and one with random experts) at one layout (module docstring);
    learning rate 0, so every policy keeps the starting weights; `packed` recomputes activations."""
    setup = torch.load(case / "routing_setup.pt", weights_only=False)
    cfg = dataclasses.replace(setup["policy_cfg"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sp, micro_batch_tokens=TOKEN_BUDGET if packed else 0,
                              recompute_activations=packed, expert_model_parallel_size=ep)

    def policy_with(**overrides) -> MegatronPolicy:
        model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32)
        return MegatronPolicy(model, dataclasses.replace(cfg, **overrides), total_steps=4)

    def train(policy: MegatronPolicy, batch: ExperienceBatch) -> tuple[dict, dict]:
        batch = dataclasses.replace(batch, old_logprobs=torch.zeros(batch.response_ids.shape))
        return policy.train(batch, SummedLogprobs(), 1.0), router_grads(policy, tp, pp, ep)

    result = {}
    plain = policy_with()
    plain.logprobs(setup["mismatch"], 1.0)
    result["mismatch"] = plain.routers.take_mismatch()
    result["plain_metrics"], result["plain_grads"] = train(plain, setup["replay"])
    on_policy = dataclasses.replace(setup["mismatch"], old_logprobs=None)
    result["on_policy_metrics"] = plain.train(on_policy, SummedLogprobs(), 1.0)
    result["aux_metrics"], result["aux_grads"] = train(policy_with(router_aux_loss_coef=setup["aux_coef"]),
                                                       setup["replay"])
    replayed = policy_with(routing_replay=True)
    reference = replayed.frozen_reference()
    result["replay_logprobs"] = replayed.logprobs(setup["replay"], 1.0)[0]
    result["reference_logprobs"] = reference.logprobs(setup["replay"], 1.0)
    result["replay_metrics"], result["replay_grads"] = train(replayed, setup["replay"])
    if dist.get_rank() == 0:
        torch.save(result, case / layout_name(tp, pp, sp, "routing_", packed, ep))


def routing_cases(root: Path) -> None:
    """`routing_case` for every `*_routing` case and layout of `routing_cases.txt`."""
    for line in (root / "routing_cases.txt").read_text().splitlines():
        name, layout = line.split()
        tp, pp, sp, packed, ep = parse_layout(layout)
        routing_case(root / name, tp, pp, sp, packed, ep)


def main() -> None:
    torch.set_num_threads(1)
    init_distributed()
    routing_cases(Path(sys.argv[1]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
