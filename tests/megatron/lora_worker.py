"""Runs under `torchrun --nproc_per_node=2` (gloo, CPU), launched by test_megatron_lora.py: LoRA
adapters on this rank's GPTModel shards (models/megatron/lora.py) at TP=1 (DP=2), TP=2, TP=2 with
sequence parallelism and PP=2.

For every case (an HF checkpoint + `batch.pt` + `prompts.pt` under the work directory) and layout:
- adapters attached, B set from one whole tensor per adapter (`set_b`, drawn the same at every
  layout, then cut to the rank's shard), then: the response log-probs with the adapters on and off,
  the gradient of the summed valid log-probs (adapters only), the adapters and their gradients in
  peft's names and HF layout (`lora.peft_state`), the merged HF weights (`weights.refit_hf_model`) and
  the rollout engine's greedy outputs on the shards;
- one `MegatronPolicy.train` call with LoRA from B = 0: the trained adapters, the KL reference's
  log-probs, how many tensors the optimizer holds and whether the base moved; its checkpoint, then a
  second update; a TP=1 policy loads the TP=2 checkpoint and makes that second update too.
Rank 0 writes `<case>/lora_<layout>.pt`.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from worker import CHUNK, micro_batches, refit_into_zeros

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.megatron import convert, forward, lora
from aligner_ext.models.megatron.decoder import MegatronGenerationModel
from aligner_ext.models.megatron.model import build_gpt_model, transformer_config
from aligner_ext.models.megatron.optimizer import wrap_ddp
from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel
from aligner_ext.models.megatron.policy import MegatronPolicy
from aligner_ext.models.settings import LoraConfig, OptimConfig, PolicyConfig
from aligner_ext.models.tiny import build_char_tokenizer

LORA = LoraConfig(rank=4, alpha=8.0)
LAYOUTS = {"tp1": (1, 1, False), "tp2": (2, 1, False), "tp2_sp": (2, 1, True), "tp1_pp2": (1, 2, False)}
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0, return_logprobs=True)


def set_b(adapters: list, tp: int) -> None:
    """Each adapter's B from one whole tensor in the TP=1 layout, cut as the weight is cut (the fused
    gate/up rows: the rank's gate rows, then its up rows)."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for adapter in adapters:
            generator = torch.Generator().manual_seed(100 * adapter.layer + list(lora.LINEARS).index(adapter.name))
            whole = torch.randn(adapter.b.shape[0] * (tp if adapter.column else 1), LORA.rank, generator=generator)
            if adapter.name == "linear_fc1":
                gate, up = whole.chunk(2)
                local = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
            else:
                local = whole.chunk(tp)[rank] if adapter.column else whole
            adapter.b.copy_(0.2 * local)


def read_batch(case: Path) -> ExperienceBatch:
    tensors = torch.load(case / "batch.pt")
    mask = tensors["response_valid"]
    return ExperienceBatch(samples=[SampleInfo(row=None) for _ in range(len(mask))], response_mask=mask,
                           group_ids=torch.tensor([0, 0, 1]), **tensors)


def sharded_run(case: Path, tp: int, pp: int, sp: bool, device) -> dict:
    hf_config = AutoConfig.from_pretrained(case)
    batch = read_batch(case)
    init_model_parallel(tp, pp)
    model = build_gpt_model(hf_config, transformer_config(hf_config, tp, pp, torch.float32, sp), device)
    convert.load_shard(model, convert.hf_to_megatron_shard(
        load_file(case / "model.safetensors"), hf_config, tp, pp, parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank()))
    adapters = lora.attach(model, LORA)
    set_b(adapters, tp)
    micro, rows = micro_batches(batch, device, tp if sp else 1, packed=False)
    order = torch.tensor(rows).argsort()
    lp, _ = forward.forward_logprobs(model, micro, hf_config.vocab_size, CHUNK, 1.0)
    with lora.adapters_off(adapters):
        base_lp, _ = forward.forward_logprobs(model, micro, hf_config.vocab_size, CHUNK, 1.0)
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    ddp.zero_grad_buffer()
    forward.forward_backward(ddp, micro, hf_config.vocab_size, CHUNK, 1.0,
                             lambda lp, micro: ((lp * micro.response_valid).sum(), {}))
    replicas = parallel_state.get_data_parallel_world_size()  # each DP rank ran the whole batch, DDP sums them
    as_grads = [SimpleNamespace(a=adapter.a.main_grad / replicas, b=adapter.b.main_grad / replicas,
                                column=adapter.column, name=adapter.name, layer=adapter.layer) for adapter in adapters]
    frozen = [name for name, param in model.named_parameters() if param.requires_grad and not lora.is_adapter(name)]
    engine = RolloutEngine(MegatronGenerationModel(model, hf_config, GenerationConfig.from_pretrained(case)),
                           build_char_tokenizer(), RolloutEngineConfig(max_batch_size=3))
    greedy = [(o.token_ids, o.logprobs) for o in engine.generate(torch.load(case.parent / "prompts.pt"), GREEDY)]
    return {"logprobs": lp[order], "base_logprobs": base_lp[order], "adapters": lora.peft_state(adapters, hf_config),
            "grads": lora.peft_state(as_grads, hf_config), "merged": refit_into_zeros(model, hf_config),
            "trainable_base": frozen, "greedy": greedy}


def policy_cfg(tp: int, pp: int, sp: bool) -> PolicyConfig:
    return PolicyConfig(backend="megatron", dtype="float32", device="cpu", micro_batch_size=1, mini_batch_size=2,
                        logprob_chunk_size=CHUNK, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        sequence_parallel=sp, optim=OptimConfig(lr=1e-2, eps=1e-4, grad_clip=1.0), lora=LORA)


def train_run(case: Path, layout: str, tp: int, pp: int, sp: bool) -> dict:
    hf_config = AutoConfig.from_pretrained(case)
    policy = MegatronPolicy(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32), policy_cfg(tp, pp, sp), 4)
    base = {name: param.detach().clone() for name, param in policy.core.named_parameters() if not lora.is_adapter(name)}
    reference = policy.frozen_reference()
    batch = read_batch_with_advantages(case)
    train_step(policy, batch)
    moved = [name for name, param in policy.core.named_parameters()
             if name in base and not torch.equal(param, base[name])]
    checkpoint = case / f"lora_checkpoint_{layout}"
    if dist.get_rank() == 0:
        checkpoint.mkdir()
    dist.barrier()
    policy.save_sharded(checkpoint)
    held = sum(len(group["params"]) for group in policy.optimizer.param_groups)
    result = {"trained": lora.peft_state(policy.adapters, hf_config), "reference": reference.logprobs(batch, 1.0),
              "optimizer_tensors": held, "adapter_tensors": 2 * len(policy.adapters), "base_moved": moved}
    train_step(policy, read_batch_with_advantages(case))
    return {**result, "trained_twice": lora.peft_state(policy.adapters, hf_config)}


def read_batch_with_advantages(case: Path) -> ExperienceBatch:
    batch = read_batch(case)
    batch.advantages = torch.tensor([[1.0], [-0.5], [0.25]]).expand(3, 4).clone()
    return batch


def train_step(policy: MegatronPolicy, batch: ExperienceBatch) -> None:
    """One train call, old log-probs offset from the current ones so that the clip acts."""
    lp, _ = policy.logprobs(batch, 1.0)
    batch.old_logprobs = lp + 0.1 * batch.response_valid
    policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)


def resumed_run(case: Path) -> dict:
    """A TP=1 policy loading the TP=2 run's checkpoint (adapters and Adam's state), then its next update."""
    hf_config = AutoConfig.from_pretrained(case)
    policy = MegatronPolicy(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32), policy_cfg(1, 1, False), 4)
    policy.load_sharded(case / "lora_checkpoint_tp2")
    resumed = lora.peft_state(policy.adapters, hf_config)
    train_step(policy, read_batch_with_advantages(case))
    return {"resumed": resumed, "next_update": lora.peft_state(policy.adapters, hf_config)}


def main() -> None:
    torch.set_num_threads(1)
    device = init_distributed()
    root = Path(sys.argv[1])
    for name in (root / "cases.txt").read_text().split():
        case = root / name
        for layout, (tp, pp, sp) in LAYOUTS.items():
            result = sharded_run(case, tp, pp, sp, device)
            result.update(train_run(case, layout, tp, pp, sp))
            if dist.get_rank() == 0:
                torch.save(result, case / f"lora_{layout}.pt")
        result = resumed_run(case)
        if dist.get_rank() == 0:
            torch.save(result, case / "lora_resumed.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
