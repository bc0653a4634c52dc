"""Megatron backend on GPUs: log-prob agreement with HF and GRPO training-step throughput (also the
HF backend's policy on one GPU, `--backend hf`, for the same training measurements).

Run under torchrun, one process per GPU (scripts/bench/megatron_gpu.sh). For each layout named on
the command line (tp1, tp1_distopt on one GPU; tp2, tp2_sp, dp2, dp2_distopt on 2 GPUs) it builds a
Qwen2-architecture model of the --preset's shape (Qwen2.5-0.5B, 1.5B or 3B) from a config (random
weights, bf16, same seed on every rank) and:

1. compares `MegatronPolicy.logprobs` (bf16) and the HF model's bf16 log-probs with an HF float32
   reference on the same weights (max / mean absolute error over valid response tokens);
2. runs GRPO policy steps on a synthetic rollout batch (random prompt/response ids and lengths,
   random advantages): old log-probs, then `train` (clipped PG loss, one optimizer update), and
   times each part; the rollouts are synthetic, so generation is not part of the step;
3. with --hf-copy, checks that the HF copy of the policy (what an HF-model engine samples from)
   holds the updated weights: its log-probs after the steps against the Megatron ones. Without
   it the copy is dropped as a run generating with the rollout engine drops it
   (`generation_model("rollout")`), so memory is what such a run holds.

MFU counts the FLOPs of the real tokens only (pads are waste, not work): per sequence of n tokens
of which r are response tokens, 6 x (non-head matmul parameters) x n + 6 x (head parameters) x r
(log-probs are computed only there) + 12 x layers x heads x head_dim x n^2 for attention
(Megatron's convention, no causal halving); divided by the train time, the GPU count and the bf16
matrix rate measured here (8192^3 GEMM). Peak memory is taken per phase (old log-probs, train).
With --profile, one more train call runs under torch.profiler and its CUDA kernels, grouped by
name, go to <out>.profile_<layout>.txt. Rank 0 prints one JSON line per layout and writes them to --out.
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
from aligner_ext.models.hf import HFPolicy, response_logprobs
from aligner_ext.models.megatron.parallel import init_distributed
from aligner_ext.models.megatron.policy import MegatronPolicy

LAYOUTS = {  # name -> (TP, sequence parallel, distributed optimizer); DP = world / TP
    "tp1": (1, False, False),
    "tp1_distopt": (1, False, True),
    "tp2": (2, False, False),
    "tp2_sp": (2, True, False),
    "dp2": (1, False, False),
    "dp2_distopt": (1, False, True),
}


PRESETS = {  # Qwen2.5 shapes: (hidden, MLP, layers, heads, kv heads); vocab 151936, tied embeddings
    "qwen0_5b": (896, 4864, 24, 14, 2),
    "qwen1_5b": (1536, 8960, 28, 12, 2),
    "qwen3b": (2048, 11008, 36, 16, 2),
}


def qwen2_config(preset: str) -> Qwen2Config:
    hidden, mlp, layers, heads, kv_heads = PRESETS[preset]
    return Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32768,
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


@torch.no_grad()
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
    """Training FLOPs of the real tokens of `batch` (module docstring)."""
    head = config.vocab_size * config.hidden_size
    d = config.hidden_size // config.num_attention_heads
    per_layer = config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * d \
        + config.num_attention_heads * d * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
    lengths = batch.attention_mask.sum(dim=1).double()
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * d * float((lengths**2).sum())
    return 6 * per_layer * config.num_hidden_layers * float(lengths.sum()) + attention \
        + 6 * head * int(batch.response_valid.sum())


def profile_train(policy, batch: ExperienceBatch, loss, path: str) -> None:
    """One train call under torch.profiler: CUDA kernels grouped by name, by total time, to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        policy.train(batch, loss, 1.0)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    with open(path, "w") as handle:
        handle.write(table)


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def parse_settings(settings: list[str]) -> dict:
    """`field=value` strings as PolicyConfig keyword arguments (values read as YAML: 4, true, full)."""
    import yaml

    return {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in settings)}


def run_layout(name: str, args, peak: float) -> dict:
    tp, sequence_parallel, distributed_optimizer = LAYOUTS[name]
    config = qwen2_config(args.preset)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random initialisation on the GPU: minutes on the host at 3B
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    batch = synthetic_batch(args, config.vocab_size)
    valid = batch.response_valid
    result = {"backend": args.backend, "layout": name, "tp": tp, "dp": dist.get_world_size() // tp, "sequence_parallel": sequence_parallel,
              "distributed_optimizer": distributed_optimizer}
    if args.reference:
        reference = copy.deepcopy(hf_model).float().eval()
        ref_lp = hf_logprobs(reference, batch, args.chunk)
        del reference
        result["logprob_err_hf_bf16_vs_hf_fp32"] = errors(hf_logprobs(hf_model, batch, args.chunk), ref_lp, valid)
    cfg = PolicyConfig(backend=args.backend, dtype="bfloat16", micro_batch_size=args.micro,
                       logprob_chunk_size=args.chunk, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                       use_distributed_optimizer=distributed_optimizer, optim=OptimConfig(lr=1e-5),
                       **parse_settings(args.set))
    policy = (MegatronPolicy if args.backend == "megatron" else HFPolicy)(hf_model, cfg, total_steps=args.steps + 2)
    del hf_model
    if args.backend == "megatron" and not args.hf_copy:
        policy.generation_model("rollout")
    torch.cuda.empty_cache()
    if args.reference:
        result["logprob_err_megatron_bf16_vs_hf_fp32"] = errors(policy.logprobs(batch, 1.0)[0], ref_lp, valid)
    loss = ClippedPGLoss(ClippedPGLoss.Config())
    times = {"logprobs_s": [], "train_s": [], "sync_s": []}
    for step in range(args.steps + 1):  # step 0 warms up
        torch.cuda.reset_peak_memory_stats()
        (old, _), t_lp = timed(lambda: policy.logprobs(batch, 1.0))
        result["peak_mem_logprobs_gib"] = torch.cuda.max_memory_allocated() / 2**30
        batch.old_logprobs = old
        torch.cuda.reset_peak_memory_stats()
        metrics, t_train = timed(lambda: policy.train(batch, loss, 1.0))
        result["peak_mem_train_gib"] = torch.cuda.max_memory_allocated() / 2**30
        _, t_sync = timed(policy.sync_weights)  # the loop's weight-sync stage: refit of the HF copy, if kept
        if step:
            times["logprobs_s"].append(t_lp)
            times["train_s"].append(t_train)
            times["sync_s"].append(t_sync)
    mean = {key: sum(v) / len(v) for key, v in times.items()}
    tokens = int(batch.attention_mask.sum())
    result.update(mean)
    result["step_s"] = mean["logprobs_s"] + mean["train_s"] + mean["sync_s"]
    result["real_tokens"] = tokens
    result["padded_positions"] = len(batch) * batch.input_ids.shape[1]
    result["train_tokens_per_s"] = tokens / mean["train_s"]
    result["step_tokens_per_s"] = tokens / result["step_s"]
    result["train_mfu"] = step_flops(config, batch) / mean["train_s"] / dist.get_world_size() / (peak * 1e12)
    result["last_loss"] = metrics["loss/total"]
    result["memory_after_train_gib"] = torch.cuda.memory_allocated() / 2**30
    if args.hf_copy:
        new_lp, _ = policy.logprobs(batch, 1.0)
        result["hf_copy_after_steps_vs_megatron"] = errors(hf_logprobs(policy.model, batch, args.chunk), new_lp, valid)
    if args.profile:
        profile_train(policy, batch, loss, f"{args.out}.profile_{name}.txt")
    del policy
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts", nargs="+", choices=sorted(LAYOUTS))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen0_5b")
    parser.add_argument("--backend", choices=["megatron", "hf"], default="megatron",
                        help="hf: the HF backend's policy on one GPU (layout tp1), for the same measurements")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=PolicyConfig().logprob_chunk_size,
                        help="policy.logprob_chunk_size (default: the library's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="PolicyConfig field=value (repeatable)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the float32 HF reference log-probs (a second full model in memory)")
    parser.add_argument("--hf-copy", action="store_true", help="keep the HF copy and check it after the steps")
    parser.add_argument("--profile", action="store_true", help="profile one more train call (module docstring)")
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
