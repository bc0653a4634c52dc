"""One system of the GRPO-step benchmark: our loop, plain GRPO or one variant, in its own process.

Builds the run's components from conf/ exactly as `aligner-ext train` does (the workspace's model
and rows, `rollout.ignore_eos`), then runs the loop's own step (`make_experience` + `update_policy`)
under a phase clock. Called by scripts/bench/grpo_step.py; writes one JSON file.

With `trainer.asynchronous.enabled=true` (a `--set`) the batches are generated ahead in the maker's
thread (aligner_ext/experience/ahead.py): the clock times the trainer's thread only, and each step
records its batch's generation time in that thread, the trainer's wait and the generator's idle time.
`--long-tail`: the responses' lengths are long-tailed (grpo_step_lib.LongTail); `--long-tail-by-prompt`: the
same share chosen per prompt, which a run that carries groups over can resume (grpo_step_lib.LongTailByPrompt).

`--serve-on GPU` (the disaggregated placement, docs/async.md): the `--engine` runs in `aligner-ext serve`,
a process of its own that sees GPU alone (`cpu`: on the CPU), and the trainer generates through it
(`generator.engine=remote`), the weights pushed over a weight group (NCCL between two GPUs, gloo on the
CPU): after each update, or with generation ahead between two batches, carrying their version.

    python scripts/bench/grpo_step_ours.py --workspace DIR --out FILE [--variant dapo] [--steps 5]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from common import slow_steps  # noqa: E402
from grpo_step_lib import (DATA_SOURCE, LongTail, LongTailByPrompt, PhaseClock, Preset, clock_loop_phases,  # noqa: E402
                           clock_trainer_phases, profiled_step, write_json, write_profile)

VARIANT_OVERRIDES = {  # what each variant overlay needs beyond the shared workload
    "none": [],
    "dapo": ["+variant=dapo"],
    "cpo": ["+variant=cpo"],
    "graded_prompt": ["+variant=graded_prompt"],
    "mtpo": ["+variant=mtpo"],  # lengths set below from the preset
}


def overrides(preset: Preset, workspace: Path, variant: str, lr: float, engine: str, eos: bool = False) -> list[str]:
    """The run's config overrides; `eos`: responses end at EOS (lengths vary from step to step, as in
    training) instead of all running to R tokens."""
    sequences = preset.prompts * preset.n
    # prompts may take every position the responses leave (the config refuses more than the model's)
    response = preset.response_length + (preset.response_length // 2 if variant == "mtpo" else 0)
    positions = json.loads((workspace / "model" / "config.json").read_text())["max_position_embeddings"]
    common = [
        f"model.path={workspace / 'model'}", f"data.train_files=[{workspace / 'rows.jsonl'}]",
        f"data.train_batch_size={preset.prompts}", f"data.max_prompt_length={positions - response}",
        "data.shuffle=false",
        f"rollout.n={preset.n}", f"rollout.max_response_length={preset.response_length}",
        f"rollout.ignore_eos={str(not eos).lower()}",
        f"+reward.sources.{DATA_SOURCE}=grpo_step_lib:score", "loss.kl_coef=0.0",
        f"policy.device={preset.device}", f"policy.micro_batch_size={preset.micro_batch}", f"policy.optim.lr={lr}",
        f"generator.engine={engine}", f"generator.hf.batch_size={sequences}",
        f"generator.rollout.max_batch_size={sequences}",
        f"trainer.output_dir={workspace / 'runs'}", f"trainer.run_name=ours_{engine}_{variant}", "trainer.progress_bar=false",
        "trainer.tensorboard=false",
    ]
    if variant == "mtpo":  # G = 2 answers of the full length, H = 4 confidences of half of it
        common += [f"mtpo.max_answer_length={preset.response_length}",
                   f"mtpo.max_confidence_length={preset.response_length // 2}"]
    return VARIANT_OVERRIDES[variant] + common


@contextmanager
def served_on(gpu: str, settings: list[str], sequences: int, directory: Path, timeout_s: float = 300):
    """`aligner-ext serve` of the run's model and engine (`settings`) in a process of its own that sees `gpu`
    alone (`cpu`: on the CPU), its log in `directory`/server.log; yields the overrides that make the trainer
    generate through it, each engine call one request (the server batches it whole)."""
    import openai

    from aligner_ext.distributed import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent),
                                                        str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    device = ["policy.device=cpu"] if gpu == "cpu" else ["policy.device=cuda"]
    if gpu != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = gpu
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "aligner_ext", "serve", *settings, *device, f"serve.port={port}",
               f"serve.max_prompts_per_request={sequences}", f"trainer.output_dir={directory}"]
    with open(directory / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.get("/health", cast_to=object)
                break
            except openai.APIConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"aligner-ext serve did not start; see {directory / 'server.log'}") from None
                time.sleep(0.5)
        yield ["generator.engine=remote", f"generator.remote.urls=[{url}]", "generator.remote.weight_sync=distributed",
               "generator.remote.weight_sync_address=127.0.0.1", f"generator.remote.max_prompts_per_request={sequences}"]
    finally:
        process.terminate()
        process.wait(timeout=60)


def probe_logprobs(policy, probe_path: Path) -> torch.Tensor:
    """Our policy's log-probs of the workspace's probe responses (no padding: every prompt is P tokens)."""
    from aligner_ext.batch import ExperienceBatch, SampleInfo
    from aligner_ext.data.types import PromptRow

    probe = torch.load(probe_path)
    prompts, responses = probe["prompt_ids"], probe["response_ids"]
    row = PromptRow(row_id="probe", messages=[], data_source=DATA_SOURCE)
    batch = ExperienceBatch(
        prompt_ids=prompts, prompt_mask=torch.ones_like(prompts, dtype=torch.bool), response_ids=responses,
        response_valid=torch.ones_like(responses, dtype=torch.bool),
        response_mask=torch.ones_like(responses, dtype=torch.bool), group_ids=torch.arange(len(prompts)),
        samples=[SampleInfo(row=row) for _ in range(len(prompts))])
    return policy.logprobs(batch, 1.0)[0]


class GenerationLedger:
    """Counts what every engine call produced (sequences, tokens, shortest and longest response, wall
    seconds; the call returns once its tokens are on the host)."""

    def __init__(self, engine, close_answers_on: str | None):
        self.generate = engine.generate
        self.close_answers_on = close_answers_on
        self.calls: list[dict] = []
        engine.generate = self

    def __call__(self, prompts, params, **engine_options):
        started = time.perf_counter()
        outputs = self.generate(prompts, params, **engine_options)
        lengths = [len(output.token_ids) for output in outputs]
        self.calls.append({"sequences": len(outputs), "tokens": sum(lengths), "min_length": min(lengths, default=0),
                           "max_length": max(lengths, default=0), "max_new_tokens": params.max_new_tokens,
                           "lengths": lengths, "seconds": time.perf_counter() - started})
        if self.close_answers_on is not None and params.stop == [self.close_answers_on]:
            # MTPO on random weights: no answer ever closes, so round 2 would never run. Count every
            # full-length round-1 answer as closed, as a trained policy's mostly are.
            for output in outputs:
                if output.finish_reason == "length":
                    output.finish_reason = "stop"
        return outputs

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


class CallsByStep:
    """The ledger's calls of each step's batch, taken in the thread that makes it, right after it
    (generation ahead makes step t + 1's batch while the trainer is in step t)."""

    def __init__(self, maker, ledger: GenerationLedger):
        self.make_experience, self.ledger = maker.make_experience, ledger
        self.steps: dict[int, list[dict]] = {}
        maker.make_experience = self

    def __call__(self, loader, step: int):
        made = self.make_experience(loader, step)
        self.steps[step] = self.ledger.take()
        return made


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", default="none", choices=sorted(VARIANT_OVERRIDES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--engine", default="hf", help="generator.engine")
    parser.add_argument("--system", default=None, help="the name reported (default: ours / ours_<engine>)")
    parser.add_argument("--set", action="append", default=[], help="one more config override (repeatable)")
    parser.add_argument("--eos", action="store_true", help="responses end at EOS (lengths vary from step to step)")
    parser.add_argument("--long-tail", action="store_true", help="long-tailed response lengths (grpo_step_lib.LongTail)")
    parser.add_argument("--long-tail-by-prompt", action="store_true",
                        help="long-tailed response lengths chosen per prompt (grpo_step_lib.LongTailByPrompt)")
    parser.add_argument("--serve-on", default=None, help="a GPU index (or cpu): the engine runs in `aligner-ext serve` "
                        "there and the trainer generates through it (module docstring)")
    parser.add_argument("--profile-first-step", action="store_true",
                        help="run the first step under cProfile: its heaviest calls in <out>.first_step_profile.txt")
    parser.add_argument("--profile-slow-steps", action="store_true",
                        help="run every measured step under cProfile and keep those above 1.3x the median: where "
                             "a slow step's host time went, in <out>.step<K>_profile.txt")
    parser.add_argument("--torch-profile", default="", help="phases (comma-separated: train, logprobs, generation, "
                        "...) of one more step after the measured ones to run under torch.profiler: where their "
                        "device time went, in <out>.torch_profile.txt (generation's 10^5 kernels take a minute)")
    args = parser.parse_args(argv)
    preset = Preset(**json.loads((args.workspace / "preset.json").read_text())["preset"])
    settings = overrides(preset, args.workspace, args.variant, args.lr, args.engine, args.eos) + args.set
    # one step more than measured: generation ahead stops there, and the step after the measured ones
    # (the profiled one, or else the batch taken below) leaves no batch in flight at exit
    settings.append(f"trainer.total_steps={args.warmup + args.steps + 1}")
    if args.serve_on is None:
        return measure(args, preset, settings)
    with served_on(args.serve_on, settings, preset.prompts * preset.n, args.out.with_suffix(".server")) as remote:
        return measure(args, preset, settings + remote)


def measure(args, preset: Preset, settings: list[str]) -> None:
    """Build the run of `settings` and measure its steps; writes `args.out`."""
    from aligner_ext.config import load_config
    from aligner_ext.trainer.build import build_components
    from aligner_ext.trainer.loop import old_logprobs_from_training, update_policy
    from aligner_ext.trainer.metrics import StageTimer

    cfg = load_config("base", settings)
    torch.manual_seed(cfg.trainer.seed)
    parts = build_components(cfg, args.workspace / "runs" / cfg.trainer.run_name)
    probe = probe_logprobs(parts.policy, args.workspace / "probe.pt")
    torch.save(probe, args.out.with_suffix(".probe.pt"))
    asynchronous = getattr(cfg.trainer, "asynchronous", None)  # none in a tree before it (--prev)
    ahead = asynchronous is not None and asynchronous.enabled
    engine, maker = (parts.maker.engine, parts.maker.inner) if ahead else (parts.engine, parts.maker)
    if args.long_tail:
        LongTail(engine)
    if args.long_tail_by_prompt:
        LongTailByPrompt(engine, preset.prompt_length)
    calls = CallsByStep(maker, GenerationLedger(engine, cfg.mtpo.answer_stop_str if args.variant == "mtpo" else None))
    startup_s = time.perf_counter() - STARTED

    clock = PhaseClock(preset.device, own_stream=ahead)
    if ahead:  # generation and rewards run in the maker's thread: the trainer's wait is its `other`
        clock_trainer_phases(clock, parts)
    else:
        clock_loop_phases(clock, parts, (parts.engine, "generate"))
    steps, profiles = [], {}
    for step in range(args.warmup + args.steps):
        profiler = cProfile.Profile() if (args.profile_first_step and step == 0) or args.profile_slow_steps else None
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        batch, metrics = parts.maker.make_experience(parts.train_loader, step)
        trainer_wait_s = time.perf_counter() - started
        if len(batch):
            metrics.update(update_policy(parts, batch, StageTimer(), cfg.rollout.temperature))
        if profiler is not None:
            profiler.disable()
            if step == 0 and args.profile_first_step:
                write_profile(profiler, args.out.with_suffix(".first_step_profile.txt"))
            profiles[step] = profiler
        record = clock.take_step()
        record["ended_at_s"] = time.perf_counter() - STARTED
        record["generate_calls"] = calls.steps.pop(step)
        record["generation_s"] = sum(call["seconds"] for call in record["generate_calls"])
        record["trainer_wait_s"] = trainer_wait_s  # in make_experience: making the batch, or waiting for it
        record["trained_sequences"] = len(batch)
        record["trained_tokens"] = int((batch.prompt_mask.sum() + batch.response_valid.sum()).item()) if len(batch) else 0
        record["metrics"] = {key: float(value) for key, value in metrics.items() if isinstance(value, (int, float))}
        record["engine_last_call"] = dict(getattr(parts.engine, "last_call", {}))  # its graph captures
        if step == 0:  # where the warm-up went: torch.compile's time per compiled function, the engine's graphs
            from torch._dynamo.utils import compile_times

            record["compile_times"] = compile_times(repr="str", aggregate=True)
            print(record["compile_times"], record["engine_last_call"], flush=True)
        steps.append(record)
        print(f"[ours {args.engine} {args.variant}] step {step}: {record['step_s']:.2f} s "
              + " ".join(f"{k}={v:.2f}" for k, v in sorted(record["phases_s"].items())), flush=True)
    if args.profile_slow_steps:
        for index in slow_steps([record["step_s"] for record in steps[args.warmup:]]):
            write_profile(profiles[args.warmup + index], args.out.with_suffix(f".step{index}_profile.txt"))
    skipped = old_logprobs_from_training(parts, preset.prompts * preset.n)
    forward_passes = ("1 training forward/backward (its log-probs are the old ones)" if skipped
                      else "1 log-prob forward + 1 training forward/backward")
    write_json(args.out, {
        "system": args.system or ("ours" if args.engine == "hf" else f"ours_{args.engine}"), "variant": args.variant, "startup_s": startup_s, "warmup_steps": args.warmup,
        "steps": steps, "settings": {"overrides": settings,
                                     "policy_dtype": str(next(parts.generation_model.parameters()).dtype),
                                     "forward_passes_per_step": forward_passes},
    })
    if args.torch_profile:  # one more step, not a measured one (written above): each phase under torch.profiler
        def step() -> None:
            batch, _ = parts.maker.make_experience(parts.train_loader, args.warmup + args.steps)
            if len(batch):
                update_policy(parts, batch, StageTimer(), cfg.rollout.temperature)

        record = profiled_step(clock, args.torch_profile, step, args.out.with_suffix(".torch_profile.txt"))
        print(f"[ours {args.engine} {args.variant}] profiled step: {record['step_s']:.2f} s", flush=True)
    elif ahead:  # the thread's last batch, so that it ends before the process does
        parts.maker.make_experience(parts.train_loader, args.warmup + args.steps)
    parts.rewards.close()


if __name__ == "__main__":
    main()
