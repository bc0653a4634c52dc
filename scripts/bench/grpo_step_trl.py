"""One system of the GRPO-step benchmark: TRL's GRPOTrainer in one of three modes, in its own process.

Modes (every other setting is TRL's default, except the shared workload: prompts, n, lengths, lr,
constant schedule, KL off, one optimizer update per generation batch):
  default  float32 weights under bf16 autocast (GPU), gradient checkpointing on, micro-batch 8
  fast     bf16 weights, no gradient checkpointing, the preset's micro-batch (its fastest mode without vLLM)
  cb       fast + `use_transformers_continuous_batching`

Every response is forced to the full length: `generation_kwargs={"min_new_tokens": R}` for
`generate` (EOS is masked out of the logits until R tokens); continuous batching drops that
processor, so there `eos_token_id=-1` (transformers' "no EOS") instead. TRL's logged completion
lengths are kept so the driver can check both.

Phases come from TRL's own profiling contexts (generate, rewards, `_get_per_token_logps_and_entropies`
inside `_prepare_inputs` = log-prob passes, `compute_loss`) plus backward, gradient clipping and the
optimizer step; see PhaseClock. Called by scripts/bench/grpo_step.py; writes one JSON file.

    python scripts/bench/grpo_step_trl.py --workspace DIR --mode fast --out FILE [--steps 5]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from grpo_step_lib import PhaseClock, Preset, trl_reward, write_json  # noqa: E402

# TRL profiling-context names -> our phase names; an unlisted name (a reward function's) takes its parent's.
TRL_PHASES = {"transformers.generate": "generation", "transformers.generate_batch": "generation",
              "_calculate_rewards": "rewards", "_prepare_inputs": "other", "compute_loss": "train"}


def trl_config(preset: Preset, mode: str, workspace: Path, steps: int, lr: float):
    from trl import GRPOConfig

    sequences = preset.prompts * preset.n
    micro = 8 if mode == "default" else preset.micro_batch  # 8: TrainingArguments' default
    length = preset.response_length
    settings = dict(
        output_dir=str(workspace / "runs" / f"trl_{mode}"), max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=sequences // micro, num_generations=preset.n, max_completion_length=length,
        learning_rate=lr, lr_scheduler_type="constant", beta=0.0, num_iterations=1, temperature=1.0, top_p=1.0,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
        generation_kwargs={"eos_token_id": -1} if mode == "cb" else {"min_new_tokens": length},
    )
    if preset.device == "cpu":
        settings.update(use_cpu=True, bf16=False)  # no bf16 autocast on the CPU: float32 like ours
    if mode in ("fast", "cb"):
        settings.update(gradient_checkpointing=False)
        if preset.device == "cuda":
            settings.update(model_init_kwargs={"dtype": "bfloat16"})
    if mode == "cb":
        settings.update(use_transformers_continuous_batching=True)
    return GRPOConfig(**settings), settings


def install_phase_clock(trainer, clock: PhaseClock, steps: list, report=lambda: None) -> None:
    """Route TRL's profiling contexts, backward, clipping and the optimizer step through `clock`;
    `report()` after every step, so a worker stopped at its time limit keeps the steps it finished."""
    from transformers import TrainerCallback
    from trl.extras import profiling

    def enter(context):
        name = context.name.partition(".")[2]  # "<trainer class>.<name>"
        if name == "_get_per_token_logps_and_entropies":
            phase = "logprobs" if clock.stack and clock.stack[-1] == "other" else "train"
        else:
            phase = TRL_PHASES.get(name) or (clock.stack[-1] if clock.stack else "other")
        clock.push(phase)
        return context

    def leave(context, *exc):
        clock.pop()
        return False

    profiling.ProfilingContext.__enter__ = enter
    profiling.ProfilingContext.__exit__ = leave
    clock.wrap(trainer.accelerator, "backward", "train")
    clock.wrap(trainer, "_clip_grad_norm", "train")

    class StepCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.take_step()  # the step clock starts here

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            clock.push("train")

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.pop()

        def on_step_end(self, args, state, control, **kwargs):
            record = clock.take_step()
            record["metrics"] = {}
            record["ended_at_s"] = time.perf_counter() - STARTED
            steps.append(record)
            print(f"[trl] step {len(steps) - 1}: {record['step_s']:.2f} s "
                  + " ".join(f"{k}={v:.2f}" for k, v in sorted(record["phases_s"].items())), flush=True)
            report()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if steps and logs:  # the log of step k comes right after its on_step_end
                steps[-1]["metrics"].update({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})
                report()  # with its metrics (lengths, tokens), in case the worker stops at its limit next

    trainer.add_callback(StepCallback())


def probe_logprobs(trainer, probe_path: Path, response_length: int) -> torch.Tensor:
    """TRL's own log-prob function on the probe, under the autocast its training step uses."""
    probe = torch.load(probe_path)
    ids = torch.cat([probe["prompt_ids"], probe["response_ids"]], dim=1).to(trainer.accelerator.device)
    with torch.no_grad(), trainer.accelerator.autocast():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids),
                                                          response_length, batch_size=len(ids))[0]
    return logps.float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("default", "fast", "cb"), required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()

    import trl
    from datasets import Dataset
    from trl import GRPOTrainer

    preset = Preset(**json.loads((args.workspace / "preset.json").read_text())["preset"])
    rows = [json.loads(line) for line in (args.workspace / "rows.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]}
                                 for row in rows])
    config, settings = trl_config(preset, args.mode, args.workspace, args.warmup + args.steps, args.lr)
    trainer = GRPOTrainer(model=str(args.workspace / "model"), reward_funcs=trl_reward, args=config,
                          train_dataset=dataset)
    probe = probe_logprobs(trainer, args.workspace / "probe.pt", preset.response_length)
    torch.save(probe, args.out.with_suffix(".probe.pt"))
    startup_s = time.perf_counter() - STARTED
    steps: list = []

    def report() -> None:
        model_dtype = str(next(trainer.model.parameters()).dtype)
        write_json(args.out, {
            "system": f"trl_{args.mode}", "variant": "none", "startup_s": startup_s, "warmup_steps": args.warmup,
            "steps": steps, "settings": {"trl": trl.__version__, "GRPOConfig": settings, "weights_dtype": model_dtype,
                                         "bf16_autocast": bool(config.bf16),
                                         "gradient_checkpointing": bool(config.gradient_checkpointing),
                                         "forward_passes_per_step": "1 training forward/backward (no old-log-prob "
                                                                    "pass: num_iterations=1, steps_per_generation = "
                                                                    "accumulation)"},
        })

    install_phase_clock(trainer, PhaseClock(preset.device), steps, report)
    trainer.train()
    report()


if __name__ == "__main__":
    main()
