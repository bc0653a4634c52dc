"""Generation alone: the rollout engine (generation/rollout.py) in its settings against the HF engine,
same weights and prompts, against the decode bound, with a profile of where a decoding step's time goes.

    python scripts/bench/run.py rollout --preset embedded     # one GPU
    python scripts/bench/run.py rollout --preset tiny         # the CPU (tests/bench)

Workload: the GRPO step's generation of a preset of scripts/bench/grpo_step_lib.py (`prompts`
prompts of exactly P tokens, n samples each, every response exactly R tokens: ignore_eos,
temperature 1, log-probs returned), random weights from a config, bf16 on the GPU.

Engines (--engines):
  hf          the HF engine (generation/hf.py), one batch of every sequence;
  eager       the rollout engine with cuda_graphs=false, compile=false;
  graphs      cuda_graphs=true, compile=false;
  compiled    cuda_graphs=true, compile=true (the engine's defaults: attention=auto, the Triton kernel on a GPU);
  compiled_stop  the defaults with a stop string that never occurs (the per-token stop-string
              check of MTPO's first round: host-side decoding of each sequence's tail every step);
  compiled_unfused  the defaults with q/k/v and gate/up as separate products (fuse_projections=false);
  compiled_flex  the defaults with FlexAttention for the decode attention (attention=flex);
  compiled_triton  the defaults with the Triton kernel (generation/decode_attention.py) named explicitly;
  compiled_sdpa  the defaults with torch SDPA (cuDNN on an H100) for the decode attention;
  compiled_megatron  the defaults on a Megatron GPTModel built from the same weights at TP=1
              (models/megatron/decoder.py: what the Megatron backend generates with; needs megatron-core).

--round2 ENGINES: MTPO's second round after the first, for each engine: every first-round sequence's prompt +
its response + a 3-token question, ROUND2_COPIES times, continued for ROUND2_TOKENS tokens; the second
call's time with the engine's kept cache (`prefix_cache`, default on) and without it (a fresh engine
of the same settings but prefix_cache=false), and the prompt tokens the kept cache served.

Checks (after the speed runs, on 16 prompts x 32 tokens; PASS/FAIL lines, exit 1 on a FAIL): greedy
and seeded-sampled tokens of `graphs` identical to `eager` (the same kernels, replayed); each
engine's sampled log-probs against the model's forward over prompt + response (the trainer's
recomputation; INFO), `compiled`'s gap within 1.5x `eager`'s + 2e-3 (fused kernels round
differently; comparing tokens would not do: a random model's near-ties flip under any rounding).

Speed: per engine the first call (compilation, graph capture: the warm-up), then --repeats timed
calls; tokens/s, seconds per decoding step, and the share of the decode bound
(sum over t = 1..R of (W + B * (P + t) * k) / copy bandwidth, scripts/bench/grpo_step.py's formula).
--profile: torch.profiler over one call of --profile-engine with R = --profile-tokens: the top
kernels by GPU time, and the GPU's busy share of the call's wall time.

Writes rollout_engine.md and rollout_engine.json under --out (default bench_out/rollout_engine_<preset>).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from grpo_step import floors, measure_hardware  # noqa: E402
from grpo_step_lib import PRESETS, build_model_and_tokenizer, model_counts, prompt_ids, random_content  # noqa: E402

from aligner_ext.models.hf import cast_model  # noqa: E402

ENGINE_SETTINGS = {
    "eager": {"cuda_graphs": False, "compile": False},
    "graphs": {"cuda_graphs": True, "compile": False},
    "compiled": {"cuda_graphs": True, "compile": True},
    "compiled_stop": {"cuda_graphs": True, "compile": True},
    "compiled_unfused": {"cuda_graphs": True, "compile": True, "fuse_projections": False},
    "compiled_flex": {"cuda_graphs": True, "compile": True, "attention": "flex"},
    "compiled_triton": {"cuda_graphs": True, "compile": True, "attention": "triton"},
    "compiled_sdpa": {"cuda_graphs": True, "compile": True, "attention": "sdpa"},
    "compiled_megatron": {"cuda_graphs": True, "compile": True},
}
ROUND2_COPIES, ROUND2_TOKENS = 2, 64  # --round2: continuations per first-round sequence, and their length
NEVER_STOP = "<never occurs>"


def build_engine(name: str, model, tokenizer, sequences: int, **settings):
    from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
    from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig

    if name == "hf":
        return HFGenerationEngine(model, tokenizer, HFEngineConfig(batch_size=sequences))
    if name.endswith("_megatron"):
        model = megatron_model(model)
    return RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=sequences, **ENGINE_SETTINGS[name], **settings))


def megatron_model(model):
    """A TP=1 Megatron GPTModel with `model`'s weights, as the Megatron backend hands it to the engine."""
    from megatron.core import parallel_state

    from aligner_ext.models.megatron import convert
    from aligner_ext.models.megatron.decoder import MegatronGenerationModel
    from aligner_ext.models.megatron.model import build_gpt_model, transformer_config
    from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel

    if not parallel_state.model_parallel_is_initialized():
        init_distributed()
        init_model_parallel(1, 1)
    core = build_gpt_model(model.config, transformer_config(model.config, 1, 1, model.dtype), model.device)
    convert.load_shard(core, convert.hf_to_megatron_shard(model.state_dict(), model.config, 1, 1, 0, 0))
    return MegatronGenerationModel(core.eval(), model.config, model.generation_config)


def workload(preset, tokenizer, seed: int = 0) -> list[list[int]]:
    """`prompts` distinct prompts of exactly P tokens, each repeated n times (a GRPO batch)."""
    rng = random.Random(seed)
    overhead = len(prompt_ids(tokenizer, ""))
    prompts = []
    for _ in range(preset.prompts):
        ids = prompt_ids(tokenizer, random_content(preset, tokenizer, rng, preset.prompt_length - overhead))
        assert len(ids) == preset.prompt_length, len(ids)
        prompts += [ids] * preset.n
    return prompts


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_call(engine, prompts, params, device: str, fresh: bool = True) -> tuple[float, list]:
    """One call's seconds and outputs; `fresh`: without the cache kept from the previous call (as
    in the loop, which releases it before training)."""
    if fresh:
        engine.release_memory()
    sync(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    sync(device)
    return time.perf_counter() - start, outputs


def identical_share(outputs, reference) -> float:
    return sum(o.token_ids == r.token_ids for o, r in zip(outputs, reference)) / len(reference)


def recomputed_gap(model, prompts, outputs) -> dict:
    """The engine's log-probs against the model's own forward over prompt + response (what the
    trainer recomputes: `rollout/logprob_diff_*`); every prompt has the same length."""
    ids = torch.tensor([prompt + output.token_ids for prompt, output in zip(prompts, outputs)], device=model.device)
    width = len(prompts[0])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[:, width - 1 : -1].float()
    recomputed = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, width:, None]).squeeze(-1)
    gap = (recomputed - torch.tensor([o.logprobs for o in outputs], device=recomputed.device)).abs()
    return {"mean": gap.mean().item(), "max": gap.max().item()}


def check(engines: dict, model, prompts: list[list[int]], device: str) -> tuple[dict, list[tuple[str, str]]]:
    """Graphs replay the eager step exactly; every engine's log-probs against the recomputed ones."""
    from aligner_ext.generation.base import SamplingParams

    subset = prompts[:: max(1, len(prompts) // 16)][:16]
    results, lines = {}, []
    for mode, params in {"greedy": SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True,
                                                  return_logprobs=True),
                         "sampled": SamplingParams(max_new_tokens=32, temperature=1.0, seed=5, ignore_eos=True,
                                                   return_logprobs=True)
                         }.items():
        outputs = {}
        for name, engine in engines.items():
            try:
                outputs[name] = engine.generate(subset, params)
            except Exception:  # noqa: BLE001 - one engine's failure is reported, the others still run
                lines.append(("FAIL", f"{name} {mode}: {traceback.format_exc(limit=3)}"))
        if "graphs" in outputs and "eager" in outputs:
            share = identical_share(outputs["graphs"], outputs["eager"])
            lines.append(("PASS" if share == 1.0 else "FAIL", f"graphs vs eager, {mode}: {share:.0%} identical tokens"))
        if mode == "greedy":
            continue  # temperature 0 reports temperature-1 log-probs: compared on the sampled run
        for name, out in outputs.items():
            results[name] = recomputed_gap(model, subset, out)
            lines.append(("INFO", f"{name}: |engine - recomputed log-prob| mean {results[name]['mean']:.2e}, "
                                  f"max {results[name]['max']:.2e}"))
        for name in [name for name in results if name.startswith("compiled")] if "eager" in results else []:
            ok = results[name]["mean"] <= 1.5 * results["eager"]["mean"] + 2e-3
            lines.append(("PASS" if ok else "FAIL", f"{name}'s log-prob mismatch within 1.5x eager's + 2e-3"))
    return results, lines


def round2(name: str, engine, fresh, prompts: list[list[int]], response: int, device: str, repeats: int) -> dict:
    """MTPO's second round timed after a first round, with the kept cache (`engine`) and without (`fresh`)."""
    from aligner_ext.generation.base import SamplingParams

    first = SamplingParams(max_new_tokens=response, temperature=1.0, ignore_eos=True, seed=3)
    second = SamplingParams(max_new_tokens=ROUND2_TOKENS, temperature=1.0, ignore_eos=True, return_logprobs=True, seed=4)
    result = {}
    for label, each in (("kept", engine), ("fresh", fresh)):
        times = []
        for _ in range(repeats + 1):  # the first pair warms up the second round's shapes
            answers = each.generate(prompts, first)
            continued = [p + a.token_ids + p[:3] for p, a in zip(prompts, answers) for _ in range(ROUND2_COPIES)]
            times.append(timed_call(each, continued, second, device, fresh=False)[0])
        result[label] = {"median_s": statistics.median(times[1:]), "times": times,
                         "prefix_reused_tokens": each.last_call.get("prefix_reused_tokens"),
                         "prefilled_tokens": each.last_call.get("prefilled_tokens")}
    print(f"ROUND2 {name}: kept cache {result['kept']['median_s']:.3f} s ({result['kept']['prefix_reused_tokens']:,} "
          f"prompt tokens reused, {result['kept']['prefilled_tokens']:,} prefilled), fresh prefill "
          f"{result['fresh']['median_s']:.3f} s", flush=True)
    return result


def profile(engine, prompts, params, device: str) -> dict:
    """Top kernels by device time over one call, and the device's busy share of its wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    engine.release_memory()
    sync(device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        engine.generate(prompts, params)
        sync(device)
    wall = time.perf_counter() - start
    attribute = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attribute) > 0]
    if device == "cuda":  # kernels only: CPU-side operator rows also carry their kernels' device time
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(getattr(e, attribute) for e in events) / 1e6
    top = sorted(events, key=lambda e: getattr(e, attribute), reverse=True)[:25]
    return {"wall_s": wall, "busy_s": busy, "busy_share": busy / wall, "kernels": sum(e.count for e in events),
            "decode_steps": dict(getattr(engine, "last_call", {})).get("decode_steps"),
            "top": [{"name": e.key[:90], "calls": e.count, "seconds": getattr(e, attribute) / 1e6} for e in top]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--engines", default="hf,eager,graphs,compiled,compiled_stop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--round2", default="", help="engines whose second round to time (comma-separated)")
    parser.add_argument("--profile-engine", default="compiled", help="engines to profile (comma-separated)")
    parser.add_argument("--no-checks", action="store_true", help="skip the token and log-prob checks")
    parser.add_argument("--profile-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from aligner_ext.generation.base import SamplingParams

    preset = PRESETS[args.preset]
    device = preset.device
    out = (args.out or HERE.parent.parent / "bench_out" / f"rollout_engine_{args.preset}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [name for name in args.engines.split(",") if name]
    if device != "cuda":
        names = [name for name in names if ENGINE_SETTINGS.get(name, {}).get("cuda_graphs") is not True]
    hardware = measure_hardware(device)
    model, tokenizer = build_model_and_tokenizer(preset)
    model = cast_model(model, device, torch.bfloat16 if device == "cuda" else torch.float32).eval()
    hardware["model"] = model_counts(model.config)
    floor = floors(preset, hardware)
    prompts = workload(preset, tokenizer)
    sequences, response = len(prompts), preset.response_length
    report = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv[1:] if argv is None else argv), "preset": preset.__dict__,
              "hardware": hardware, "decode_bound_s": floor["decode_bound_s"], "engines": {}, "failures": {}}
    print(f"{args.preset}: {sequences} sequences x (P {preset.prompt_length} + R {response}), "
          f"decode bound {floor['decode_bound_s'] * 1e3:.1f} ms per call", flush=True)

    engines = {}
    for name in names:
        try:
            engines[name] = build_engine(name, model, tokenizer, sequences)
        except Exception:  # noqa: BLE001
            report["failures"][name] = traceback.format_exc(limit=5)
    for name, engine in engines.items():
        params = SamplingParams(max_new_tokens=response, temperature=1.0, ignore_eos=True, return_logprobs=True,
                                seed=1, stop=[NEVER_STOP] if name.endswith("_stop") else [])
        try:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            first_s, outputs = timed_call(engine, prompts, params, device)
            assert all(len(o.token_ids) == response for o in outputs), "a response is not R tokens"
            times = [timed_call(engine, prompts, params, device)[0] for _ in range(args.repeats)]
        except Exception:  # noqa: BLE001
            report["failures"][name] = traceback.format_exc(limit=5)
            print("FAIL", name, report["failures"][name], flush=True)
            continue
        median = statistics.median(times)
        stats = {"first_call_s": first_s, "median_s": median, "min_s": min(times), "max_s": max(times),
                 "tokens_per_s": sequences * response / median, "step_ms": median / response * 1e3,
                 "bound_share": floor["decode_bound_s"] / median,
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                 "last_call": dict(getattr(engine, "last_call", {}))}
        report["engines"][name] = stats
        print(f"RESULT {name}: {median:.3f} s [{min(times):.3f}, {max(times):.3f}], {stats['tokens_per_s']:,.0f} tok/s, "
              f"{stats['step_ms']:.2f} ms/step, {stats['bound_share']:.1%} of the decode bound, first call "
              f"{first_s:.2f} s, {stats['last_call']}", flush=True)
        write(report, out)

    if args.round2:
        report["round2"] = {}
        for name, engine in engines.items():
            if name not in args.round2.split(",") or name == "hf":
                continue
            try:
                fresh = build_engine(name, model, tokenizer, sequences * ROUND2_COPIES, prefix_cache=False)
                report["round2"][name] = round2(name, engine, fresh, prompts, response, device, args.repeats)
            except Exception:  # noqa: BLE001
                report["failures"][f"round2 {name}"] = traceback.format_exc(limit=5)
        write(report, out)

    # After the speed runs, so that each engine's first call above is its real warm-up.
    checked = {} if args.no_checks else {
        name: engines.get(name) or build_engine(name, model, tokenizer, sequences)
        for name in ("hf", "eager", "graphs", "compiled", *[name for name in engines if name.startswith("compiled_")])
        if device == "cuda" or name in ("hf", "eager")}
    report["checks"], lines = check(checked, model, prompts, device)
    for verdict, text in lines:
        print(verdict, text, flush=True)
    report["check_lines"] = lines
    params = SamplingParams(max_new_tokens=args.profile_tokens, temperature=1.0, ignore_eos=True, return_logprobs=True,
                            seed=1)
    for name in args.profile_engine.split(",") if args.profile else []:
        try:
            report.setdefault("profiles", []).append({"engine": name, "tokens": args.profile_tokens,
                                                      **profile(engines[name], prompts, params, device)})
        except Exception:  # noqa: BLE001
            report["failures"][f"profile {name}"] = traceback.format_exc(limit=5)
    print(write(report, out))
    sys.exit(1 if any(verdict == "FAIL" for verdict, _ in lines) or report["failures"] else 0)


def write(report: dict, out: Path) -> str:
    (out / "rollout_engine.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (out / "rollout_engine.md").write_text(text + "\n")
    return text


def render(report: dict) -> str:
    preset, hardware = report["preset"], report["hardware"]
    lines = [f"### Generation: {preset['name']}, {preset['prompts'] * preset['n']} sequences x (P {preset['prompt_length']}"
             f" + R {preset['response_length']}), {hardware['device_name']}, {report['date']}", "",
             f"`{report['command']}`; copy bandwidth {hardware['copy_bytes_per_s'] / 1e9:,.0f} GB/s, decode bound "
             f"{report['decode_bound_s']:.3f} s per call.", "",
             "| engine | s per call, median [min, max] | tokens/s | ms per decoding step | x HF tokens/s "
             "| share of the decode bound | first call s | graphs (capture s) | peak GiB |", "| --- " * 9 + "|"]
    hf = report["engines"].get("hf")
    for name, s in report["engines"].items():
        graphs = s["last_call"].get("graphs_captured", 0)
        lines.append(
            f"| {name} | {s['median_s']:.3f} [{s['min_s']:.3f}, {s['max_s']:.3f}] | {s['tokens_per_s']:,.0f} | "
            f"{s['step_ms']:.2f} | {s['tokens_per_s'] / hf['tokens_per_s']:.1f} | {s['bound_share']:.1%} | "
            f"{s['first_call_s']:.2f} | {graphs} ({s['last_call'].get('graph_capture_s', 0):.2f}) | "
            f"{s['peak_gib'] if s['peak_gib'] is None else round(s['peak_gib'], 2)} |"
            if hf else f"| {name} | {s['median_s']:.3f} | {s['tokens_per_s']:,.0f} | {s['step_ms']:.2f} | - | "
                       f"{s['bound_share']:.1%} | {s['first_call_s']:.2f} | {graphs} | - |")
    lines += ["", "Checks: " + "; ".join(f"{verdict} {text}" for verdict, text in report.get("check_lines", []))]
    for p in report.get("profiles", []):
        lines += ["", f"Profile of one `{p['engine']}` call, R = {p['tokens']}: wall {p['wall_s']:.3f} s, device busy "
                      f"{p['busy_s']:.3f} s ({p['busy_share']:.0%}), {p['kernels']:,} kernels over "
                      f"{p['decode_steps']} decoding steps and the prefill.", "",
                  "| kernel | calls | s | share of busy |", "| --- | --- | --- | --- |"]
        lines += [f"| `{t['name']}` | {t['calls']} | {t['seconds']:.4f} | {t['seconds'] / p['busy_s']:.1%} |"
                  for t in p["top"]]
    if report.get("round2"):
        lines += ["", f"MTPO's second round after the first ({ROUND2_COPIES} continuations of each sequence, "
                      f"{ROUND2_TOKENS} tokens), seconds, median:", "",
                  "| engine | kept cache | fresh prefill | faster | prompt tokens reused / prefilled |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {r['kept']['median_s']:.3f} | {r['fresh']['median_s']:.3f} | "
                  f"{r['fresh']['median_s'] / r['kept']['median_s']:.2f}x | {r['kept']['prefix_reused_tokens']:,} / "
                  f"{r['kept']['prefilled_tokens']:,} |" for name, r in report["round2"].items()]
    for name, why in report["failures"].items():
        lines += ["", f"FAILED {name}: {why.strip().splitlines()[-1]}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
