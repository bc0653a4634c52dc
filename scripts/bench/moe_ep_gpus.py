"""A mixture of experts on the Megatron backend under expert parallelism, on two GPUs: a few GRPO
steps of `aligner-ext train` under torchrun, so that the rollout engine's expert exchange (each EP
rank's experts, NCCL all-gather and reduce-scatter inside the decode step's CUDA graphs) runs where
it is meant to, against EP=1 (DP=2) on the same GPUs.

    python scripts/bench/moe_ep_gpus.py --out bench_out/moe_ep            # 2 GPUs
    python scripts/bench/moe_ep_gpus.py --tiny --out /tmp/moe_ep          # the CPU (2 processes): the harness

A random-weight Qwen3-MoE (`family_config`: hidden 1024, 8 layers, 32 experts of 512, top 8) over the
built-in task's character tokenizer, bf16; 16 prompts x n=8, responses up to 256 tokens (random
weights rarely stop early). Per run (`RUNS`): the steps' mean time after the first, the gap between
the engine's and the trainer's log-probs of the sampled tokens (`rollout/logprob_diff_mean`, `_max`:
an engine that computed other experts than the trainer's would show gaps of order 1), the routing
mismatch and the expert load. Writes moe_ep.md and moe_ep.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
             moe_intermediate_size=512, num_experts=32, num_experts_per_tok=8, max_position_embeddings=4096)
TINY_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512)
COMMON = ["policy.backend=megatron", "generator.engine=rollout", "trainer.tensorboard=false",
          "trainer.progress_bar=false", "trainer.export_hf=false", "data.builtin_val_size=4"]
WORKLOAD = ["data.train_batch_size=16", "rollout.n=8", "rollout.max_response_length=256", "policy.dtype=bfloat16"]
TINY_WORKLOAD = ["data.train_batch_size=2", "rollout.n=2", "rollout.max_response_length=8", "policy.dtype=float32",
                 "data.builtin_train_size=16"]
RUNS = {"ep1": ["policy.expert_model_parallel_size=1"],
        "ep2": ["policy.expert_model_parallel_size=2"],
        "ep2_replay": ["policy.expert_model_parallel_size=2", "policy.routing_replay=true"]}
METRICS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "moe/routing_mismatch", "moe/load_max")


def checkpoint(directory: Path, sizes: dict) -> Path:
    from aligner_ext.models.family_configs import family_config, random_model
    from aligner_ext.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = family_config("qwen3_moe", **sizes, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    random_model(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def launch(name: str, overrides: list[str], out: Path, timeout: float) -> list[dict]:
    """One run of `aligner-ext train` on 2 processes; its step records."""
    from aligner_ext.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "aligner_ext", "train", *overrides, f"trainer.output_dir={out}", f"trainer.run_name={name}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    with open(out / f"{name}.log", "w") as log:
        launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # every process prints its Python stacks (faulthandler) into the log
            subprocess.run(["pkill", "-ABRT", "-f", f"trainer.run_name={name}"])  # workers may have their own groups
            os.killpg(launcher.pid, signal.SIGABRT)
            time.sleep(10)
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            raise RuntimeError(f"run {name} ran past {timeout} s: its stacks in {out / name}.log") from None
    if launcher.returncode != 0:
        raise RuntimeError(f"run {name} failed: {out / name}.log")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    steps = [record for record in records if record.get("step", 0) > 0]
    timed = [record["timing/step_s"] for record in steps[1:] if "timing/step_s" in record]
    row = {"steps": len(steps), "step_s": statistics.mean(timed) if timed else None}
    for key in METRICS:
        values = [record[key] for record in steps if key in record]
        row[key] = max(values) if key.endswith("_max") else (statistics.mean(values) if values else None)
    return row


def render(rows: dict, command: str, device: str) -> str:
    lines = [f"# A mixture of experts under expert parallelism ({device})", "", f"`{command}`", "",
             "| run | steps | step s | " + " | ".join(METRICS) + " |", "|" + " --- |" * (3 + len(METRICS))]
    for name, row in rows.items():
        cells = [f"{row[key]:.4g}" if isinstance(row[key], float) else str(row[key]) for key in METRICS]
        step = f"{row['step_s']:.2f}" if row["step_s"] is not None else "-"
        lines.append(f"| {name} | {row['steps']} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "moe_ep")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    parser.add_argument("--tiny", action="store_true", help="a tiny model in float32 on the CPU: checks the harness")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per run")
    args = parser.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    model = checkpoint(args.out / "model", TINY_SIZES if args.tiny else SIZES)
    workload = TINY_WORKLOAD if args.tiny else WORKLOAD
    rows = {}
    for name in args.runs.split(","):
        overrides = [f"model.path={model}", *COMMON, *workload, *RUNS[name], f"trainer.total_steps={args.steps}"]
        rows[name] = summary(launch(name, overrides, args.out, args.timeout))
        print(name, rows[name], flush=True)
    device = torch.cuda.get_device_name() + " x2" if torch.cuda.is_available() else "CPU, 2 processes"
    command = "python scripts/bench/moe_ep_gpus.py " + " ".join(argv)
    (args.out / "moe_ep.md").write_text(render(rows, command, device))
    (args.out / "moe_ep.json").write_text(json.dumps({"device": device, "command": command, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
