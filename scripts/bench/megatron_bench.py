"""Megatron backend on GPUs: log-prob agreement with HF and GRPO training-step throughput.

Run under torchrun, one process per GPU (scripts/bench/megatron_gpu.sh). For each layout named on
the command line (tp2, tp2_sp, dp2, dp2_distopt on 2 GPUs) it builds a Qwen2-architecture model of
Qwen2.5-0.5B's shape from a config (random weights, bf16, same seed on every rank) and:

1. compares `MegatronPolicy.logprobs` (bf16) and the HF model's bf16 log-probs with an HF float32
   reference on the same weights (max / mean absolute error over valid response tokens);
2. runs GRPO policy steps on a synthetic rollout batch (random prompt/response ids and lengths,
   random advantages): old log-probs, then `train` (clipped PG loss, one optimizer update), and
   times each part; the rollouts are synthetic, so generation is not part of the step;
3. checks that the HF copy of the policy (what the generation engine samples from) holds the
   updated weights: its log-probs after the steps against the Megatron ones.

MFU counts the FLOPs the step performs: 6 x (non-head matmul parameters) per token of every
sequence position, 6 x (head parameters) per response token (log-probs are computed only there),
and 12 x layers x heads x head_dim x sequence length per token for attention (Megatron's
convention, no causal halving); divided by the step time, the GPU count and the bf16 matrix rate
measured here (8192^3 GEMM). Rank 0 prints one JSON line per layout and writes them to --out.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.base import OptimConfig, PolicyConfig
from aligner_ext.models.hf import response_logprobs
from aligner_ext.models.megatron.parallel import init_distributed
from aligner_ext.models.megatron.policy import MegatronPolicy

LAYOUTS = {  # name -> (TP, sequence parallel, distributed optimizer); DP = world / TP
    "tp2": (2, False, False),
    "tp2_sp": (2, True, False),
    "dp2": (1, False, False),
    "dp2_distopt": (1, False, True),
}


def qwen2_half_billion() -> Qwen2Config:
    """Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 / 2 heads, MLP 4864, vocab 151936, tied."""
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def synthetic_batch(args, vocab: int) -> ExperienceBatch:
    """Left-padded prompts of P/2..P tokens, right-padded responses of R/8..R tokens, seeded."""
    gen = torch.Generator().manual_seed(1)
    b, p, r = args.batch, args.prompt, args.response
    prompt_len = torch.randint(p // 2, p + 1, (b,), generator=gen)
    response_len = torch.randint(r // 8, r + 1, (b,), generator=gen)
    prompt_mask = torch.arange(p).unsqueeze(0) >= (p - prompt_len).unsqueeze(1)
    valid = torch.arange(r).unsqueeze(0) < response_len.unsqueeze(1)
    batch = ExperienceBatch(
        prompt_ids=torch.randint(1, vocab, (b, p), generator=gen) * prompt_mask, prompt_mask=prompt_mask,
        response_ids=torch.randint(1, vocab, (b, r), generator=gen) * valid, response_valid=valid,
        response_mask=valid, group_ids=torch.arange(b) // 8, samples=[SampleInfo(row=None) for _ in range(b)],
    )
    batch.advantages = torch.randn(b, 1, generator=gen).expand(b, r).clone()
    return batch


def hf_logprobs(model, batch: ExperienceBatch, chunk: int) -> torch.Tensor:
    parts = [response_logprobs(model, batch.select(list(range(i, min(len(batch), i + 4)))), chunk, False, 1.0)[0]
             for i in range(0, len(batch), 4)]
    return torch.cat(parts).float().cpu()


def errors(value: torch.Tensor, reference: torch.Tensor, valid: torch.Tensor) -> dict:
    diff = (value - reference).abs()[valid]
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def step_flops(config: Qwen2Config, batch: ExperienceBatch) -> float:
    head = config.vocab_size * config.hidden_size
    d = config.hidden_size // config.num_attention_heads
    per_layer = config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * d \
        + config.num_attention_heads * d * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
    seq = batch.input_ids.shape[1]
    positions = len(batch) * seq
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * d * seq
    return (6 * per_layer * config.num_hidden_layers + attention) * positions \
        + 6 * head * int(batch.response_valid.sum())


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def run_layout(name: str, args, peak: float) -> dict:
    tp, sequence_parallel, distributed_optimizer = LAYOUTS[name]
    config = qwen2_half_billion()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    reference = copy.deepcopy(hf_model).float().eval()
    cfg = PolicyConfig(backend="megatron", dtype="bfloat16", micro_batch_size=args.micro, logprob_chunk_size=args.chunk,
                       tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                       use_distributed_optimizer=distributed_optimizer, optim=OptimConfig(lr=1e-5))
    policy = MegatronPolicy(hf_model, cfg, total_steps=args.steps + 1)
    batch = synthetic_batch(args, config.vocab_size)
    valid = batch.response_valid
    ref_lp = hf_logprobs(reference, batch, args.chunk)
    del reference
    megatron_lp, _ = policy.logprobs(batch, 1.0)
    result = {"layout": name, "tp": tp, "dp": dist.get_world_size() // tp, "sequence_parallel": sequence_parallel,
              "distributed_optimizer": distributed_optimizer,
              "logprob_err_megatron_bf16_vs_hf_fp32": errors(megatron_lp, ref_lp, valid),
              "logprob_err_hf_bf16_vs_hf_fp32": errors(hf_logprobs(policy.model, batch, args.chunk), ref_lp, valid)}
    loss = ClippedPGLoss(ClippedPGLoss.Config())
    times = {"logprobs_s": [], "train_s": [], "sync_s": []}
    for step in range(args.steps + 1):  # step 0 warms up
        (old, _), t_lp = timed(lambda: policy.logprobs(batch, 1.0))
        batch.old_logprobs = old
        metrics, t_train = timed(lambda: policy.train(batch, loss, 1.0))
        _, t_sync = timed(policy.sync_weights)  # the loop's weight-sync stage: refit of the HF copy
        if step:
            times["logprobs_s"].append(t_lp)
            times["train_s"].append(t_train)
            times["sync_s"].append(t_sync)
    mean = {key: sum(v) / len(v) for key, v in times.items()}
    tokens = int(batch.attention_mask.sum())
    result.update(mean)
    result["step_s"] = mean["logprobs_s"] + mean["train_s"] + mean["sync_s"]
    result["train_tokens_per_s"] = tokens / mean["train_s"]
    result["step_tokens_per_s"] = tokens / result["step_s"]
    result["train_mfu"] = step_flops(config, batch) / mean["train_s"] / dist.get_world_size() / (peak * 1e12)
    result["last_loss"] = metrics["loss/total"]
    new_lp, _ = policy.logprobs(batch, 1.0)
    result["hf_copy_after_steps_vs_megatron"] = errors(hf_logprobs(policy.model, batch, args.chunk), new_lp, valid)
    result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del policy, hf_model
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts", nargs="+", choices=sorted(LAYOUTS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="megatron_bench.jsonl")
    args = parser.parse_args()
    init_distributed()
    peak = matmul_tflops()
    for name in args.layouts:
        result = run_layout(name, args, peak)
        settings = {key: value for key, value in vars(args).items() if key != "layouts"}
        result.update(settings | {"bf16_matmul_tflops": peak, "gpu": torch.cuda.get_device_name()})
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
            with open(args.out, "a") as handle:
                handle.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
