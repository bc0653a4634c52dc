"""Seconds per refit of the HF copy of the policy from the distributed GPTModel, old path vs new.

Run under torchrun with 2 processes, on CPU (gloo, float32) or on 2 GPUs (NCCL, bf16):

    torchrun --nproc_per_node=2 scripts/bench/refit_bench.py [--model small|qwen2-0.5b-shape] [tp2 pp2 dp2]

For each layout (tp2: TP=2; pp2: PP=2; dp2: two replicas) it builds a Qwen2-architecture GPTModel
from an HF model (random weights, same seed on every rank), moves every Megatron weight by a small
random step (as an optimizer update would), and times, after one warm-up call:
- new: `weights.refit_hf_model` (TP all-gather on the device, in-place copies, PP broadcasts);
- old: the path it replaced, kept here only for the comparison: TP all-gather, every shard copied to
  host memory, the stages exchanged by `all_gather_object`, `convert.megatron_to_hf`, then
  `load_state_dict` into the HF model.
It first checks that both paths leave the HF model bit-identical, so the timing compares equals.
Rank 0 prints one JSON line per layout (seconds per refit: mean and min over --repeats).
Models: `small` is ~41M parameters (8 layers, hidden 512, vocab 32,000, tied), sized for CPU;
`qwen2-0.5b-shape` is Qwen2.5-0.5B's shape (scripts/bench/megatron_bench.py).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_bench import qwen2_half_billion
from transformers import AutoModelForCausalLM, Qwen2Config

from aligner_ext.models.megatron import convert
from aligner_ext.models.megatron.model import build_gpt_model, transformer_config
from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel
from aligner_ext.models.megatron.weights import refit_hf_model

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # name -> (TP, PP); DP = world / (TP x PP)


def small_qwen2() -> Qwen2Config:
    return Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True)


MODELS = {"small": small_qwen2, "qwen2-0.5b-shape": qwen2_half_billion}


def old_refit(core: torch.nn.Module, hf_model: torch.nn.Module, hf_config) -> None:
    """The replaced path: shards through host memory, stages as pickled objects, then load_state_dict."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    shards: dict = {(stage, r): {} for r in range(tp)}
    for name, param in core.named_parameters():
        parts = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(parts, param.detach().contiguous(), group=group)
        for rank, part in enumerate(parts):
            shards[(stage, rank)][name] = part.cpu()
    if pp > 1:
        stages: list = [None] * pp
        dist.all_gather_object(stages, shards, group=parallel_state.get_pipeline_model_parallel_group())
        shards = {key: value for stage in stages for key, value in stage.items()}
    hf_model.load_state_dict(convert.megatron_to_hf(shards, hf_config, tp, pp), strict=False)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def run_layout(name: str, args, device: torch.device) -> dict:
    tp, pp = LAYOUTS[name]
    hf_config = MODELS[args.model]()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device)
    init_model_parallel(tp, pp)
    core = build_gpt_model(hf_config, transformer_config(hf_config, tp, pp, dtype, False), device)
    shard = convert.hf_to_megatron_shard(hf_model.state_dict(), hf_config, tp, pp,
                                         parallel_state.get_tensor_model_parallel_rank(),
                                         parallel_state.get_pipeline_model_parallel_rank())
    convert.load_shard(core, shard)
    del shard
    with torch.no_grad():  # an update: the HF model now differs from the GPTModel everywhere
        for param in core.parameters():
            param.add_(torch.randn_like(param) * 1e-2)
    old_refit(core, hf_model, hf_config)
    expected = {key: value.clone() for key, value in hf_model.state_dict().items()}
    with torch.no_grad():
        for param in hf_model.parameters():
            param.zero_()
    refit_hf_model(core, hf_model, hf_config)
    identical = all(torch.equal(value, expected[key]) for key, value in hf_model.state_dict().items())
    del expected
    new = seconds(lambda: refit_hf_model(core, hf_model, hf_config), args.repeats)
    old = seconds(lambda: old_refit(core, hf_model, hf_config), args.repeats)
    return {"layout": name, "tp": tp, "pp": pp, "dp": dist.get_world_size() // (tp * pp), "model": args.model,
            "parameters": sum(p.numel() for p in hf_model.parameters()), "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "bit_identical": identical, "new_s_mean": sum(new) / len(new), "new_s_min": min(new),
            "old_s_mean": sum(old) / len(old), "old_s_min": min(old), "repeats": args.repeats}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts", nargs="*", choices=sorted(LAYOUTS), help="default: tp2 pp2")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = init_distributed()
    for name in args.layouts or ["tp2", "pp2"]:
        result = run_layout(name, args, device)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
