"""Generation through `aligner-ext serve` against the same engine in process, and the cost of each
weight push mode (docs/serving.md), in one process:

    python scripts/bench/run.py serving --preset embedded      # one GPU
    python scripts/bench/run.py serving --preset tiny          # the CPU (tests/bench)

Workload: rollout_engine.py's (a GRPO batch of a preset in scripts/bench/grpo_step_lib.py: `prompts`
prompts of P tokens, n samples each, R tokens each with ignore_eos, temperature 1, log-probs), random
weights, bf16 on the GPU. The server runs the rollout engine on its own copy of the weights in a
thread of this process (HTTP over the loopback interface); the client is the `remote` engine.

Rows: the in-process rollout engine; the remote engine through one server with a call cut into
chunks of --chunk prompts (default: the whole call in one request); each after one warm-up call,
--repeats timed calls (median). Weight pushes: `disk` (save_weights to a temporary directory, the
server loads it) and `distributed` (a gloo group: every parameter broadcast from this thread to the
server's), --repeats each, with the model's size: NCCL needs two GPUs and is not measured here.

Writes serving.md and serving.json under --out (default bench_out/serving_<preset>).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "tests"))

import torch  # noqa: E402
from grpo_step_lib import PRESETS, build_model_and_tokenizer  # noqa: E402
from rollout_engine import sync, timed_call, workload  # noqa: E402

from aligner_ext.models.hf import cast_model  # noqa: E402


def median_seconds(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=0, help="prompts per request (0: the whole call)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from served_engine import serve_in_thread, serving

    from aligner_ext.generation.base import SamplingParams
    from aligner_ext.generation.remote import RemoteEngine, RemoteEngineConfig
    from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig

    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = build_model_and_tokenizer(preset)
    model = cast_model(model, device, torch.bfloat16 if device == "cuda" else torch.float32).eval()
    prompts = workload(preset, tokenizer)
    params = SamplingParams(max_new_tokens=preset.response_length, temperature=1.0, return_logprobs=True,
                            ignore_eos=True, seed=0)
    tokens = len(prompts) * preset.response_length
    engine_cfg = RolloutEngineConfig(max_batch_size=len(prompts))
    local = RolloutEngine(model, tokenizer, engine_cfg)
    served_model = copy.deepcopy(model)
    sync_dir = Path(tempfile.mkdtemp(prefix="serving_sync_"))  # the only folder the server loads weights from
    server = serving(RolloutEngine(served_model, tokenizer, engine_cfg), served_model, tokenizer,
                     weights_root=str(sync_dir))
    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    report = {"preset": args.preset, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "sequences": len(prompts), "prompt_length": preset.prompt_length,
              "response_length": preset.response_length, "weights_gb": size_gb, "chunk": args.chunk or len(prompts)}
    with serve_in_thread(server) as url:
        clients = {mode: RemoteEngine(model, tokenizer, RemoteEngineConfig(
            urls=[url], max_prompts_per_request=args.chunk or len(prompts), weight_sync=mode,
            weight_sync_dir=sync_dir, weight_sync_address="127.0.0.1", weight_sync_backend="gloo"))
            for mode in ("disk", "distributed")}
        rows = {}
        for name, engine in (("in-process rollout engine", local), ("remote engine, one local server", clients["disk"])):
            warmup_s, _ = timed_call(engine, prompts, params, device)
            seconds = median_seconds(lambda: engine.generate(prompts, params), args.repeats, device)
            rows[name] = {"warmup_s": warmup_s, "seconds": seconds, "tokens_per_s": tokens / seconds}
            print(f"{name}: {seconds:.3f} s ({tokens / seconds:,.0f} tokens/s), warm-up {warmup_s:.1f} s", flush=True)
        report["generation"] = rows
        pushes = {}
        for mode, engine in clients.items():
            engine.update_weights(model)  # the first distributed push also forms the group
            seconds = median_seconds(lambda: engine.update_weights(model), args.repeats, device)
            pushes[mode] = {"seconds": seconds, "gb_per_s": size_gb / seconds}
            print(f"weight push {mode}: {seconds:.3f} s ({size_gb / seconds:.2f} GB/s)", flush=True)
        report["weight_push"] = pushes
        same = all(torch.equal(a, b) for a, b in zip(served_model.parameters(), model.parameters()))
        report["server_weights_equal_after_push"] = same
    shutil.rmtree(sync_dir)
    out = args.out or Path("bench_out") / f"serving_{args.preset}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(report, indent=2))
    (out / "serving.md").write_text(render(report))
    print(render(report))


def render(report: dict) -> str:
    local, remote = report["generation"].values()
    lines = [f"Serving, preset `{report['preset']}` ({report['device']}): {report['sequences']} sequences x "
             f"R={report['response_length']} (P={report['prompt_length']}), {report['chunk']} prompts per request; "
             f"weights {report['weights_gb']:.2f} GB", "",
             "| generation | s per call (median) | tokens/s | warm-up s |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {row['seconds']:.3f} | {row['tokens_per_s']:,.0f} | {row['warmup_s']:.1f} |"
              for name, row in report["generation"].items()]
    lines += ["", f"remote / in-process time: {remote['seconds'] / local['seconds']:.3f}", "",
              "| weight push | s (median) | GB/s |", "| --- | --- | --- |"]
    lines += [f"| {mode} | {row['seconds']:.3f} | {row['gb_per_s']:.2f} |" for mode, row in report["weight_push"].items()]
    lines += ["", f"server weights equal to the trainer's after the pushes: {report['server_weights_equal_after_push']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
