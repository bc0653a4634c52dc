"""Sliding windows that bite: sequences several windows long, on the Megatron backend's training
forward and in the rollout engine, against transformers' own windowed attention, and their speed.

    python scripts/bench/run.py sliding-window --families gemma3_text,mistral --window 512     # one GPU
    python scripts/bench/run.py sliding-window --tiny --families gemma3_text,mistral           # the CPU (tests/bench)

Per family (families.py's config at SIZES with `sliding_window=--window`: Mistral windows every layer,
Gemma 3 five layers of six with its own RoPE base; random weights, bf16 on the GPU), in its own
process:

1. Training forward: B sequences of P + R tokens (GPU: 8 x (1024 + 3072) = 4096 tokens, 8 windows),
   random ids. Log-probs of the R response tokens by transformers' model (SDPA with its own window
   masks) in float32, log-softmax in float64: the reference. Against it, max and mean absolute
   error of transformers' model in bf16 ("transformers": what bf16 rounding alone costs), of the Megatron backend's
   log-prob pass on packed micro-batches (FlashAttention varlen with its window) and on padded rows
   (SDPA under a window mask); and, as the control, of the reference with the window lifted (full
   causal attention): the gap a kernel ignoring the window would show.
2. Rollout engine, greedy with log-probs, on the HF model (HF backend) and on the Megatron backend's
   GPTModel (the same weights): B prompts of P' tokens continued for R' tokens (GPU: 8 x (1536 +
   1024), every decode step past the window). Each sequence is then scored by transformers' float32
   forward (teacher forcing): the engine's log-probs against it (and transformers' bf16 forward
   against it, the tolerance), and its greedy tokens against the float32 argmax: the share that
   agree and the disagreements where the float32 top two are more than MARGIN apart (bf16 rounding
   flips near-ties, and a few wider gaps: transformers' own bf16 forward is the measure; a wrong
   window flips decided tokens by the hundred). Speed: tokens/s of R' decode steps against the
   decode bound with windows (each windowed layer reads its window), and the same engine with the
   windows lifted (every layer reads its whole cache).
3. Megatron training speed: --steps train calls (families.megatron_calls, packed micro-batches of
   --tokens) with the windows, then with every layer's window lifted (same weights): the train call's
   time and MFU (attention FLOPs counting each windowed query's window only).

PASS / FAIL lines: the Megatron and engine log-prob errors within 2x transformers' bf16 error +
2e-3 (mean) and the control far outside; no more decided greedy tokens different from the float32
argmax than transformers' bf16 forward has.
Writes sliding_window.md / .json under --out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from families import (  # noqa: E402
    SIZES,
    decode_bound_s,
    driver_arguments,
    driver_setup,
    megatron_calls,
    megatron_policy,
    shape,
    train_flops,
)
from grpo_step import run_worker  # noqa: E402
from grpo_step_lib import FIRST_WORD_ID, Preset, write_json  # noqa: E402

# (B, P, R) of the training forward, (B, P', R') of the rollout part; micro-batch tokens (packed)
WORK = {"gpu": dict(train=(8, 1024, 3072), rollout=(8, 1536, 1024), tokens=16384, window=512, chunk=512),
        "tiny": dict(train=(2, 16, 24), rollout=(2, 12, 20), tokens=64, window=8, chunk=16)}
MARGIN = 0.1  # nats between the float32 top two above which a greedy token is decided
LIFTED = 1 << 30  # a window no sequence reaches: full causal attention


def random_batch(rows: int, prompt: int, response: int, vocab: int, seed: int):
    """An ExperienceBatch of `rows` full sequences of random ids, random advantages."""
    import torch

    from aligner_ext.batch import ExperienceBatch, SampleInfo

    gen = torch.Generator().manual_seed(seed)
    valid = torch.ones(rows, response, dtype=torch.bool)
    batch = ExperienceBatch(
        prompt_ids=torch.randint(FIRST_WORD_ID, vocab, (rows, prompt), generator=gen),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        response_ids=torch.randint(FIRST_WORD_ID, vocab, (rows, response), generator=gen), response_valid=valid,
        response_mask=valid, group_ids=torch.arange(rows), samples=[SampleInfo(row=None) for _ in range(rows)])
    batch.advantages = torch.randn(rows, 1, generator=gen).expand(rows, response).clone()
    return batch


def teacher_forced(model, ids, prompt: int, chunk: int):
    """transformers' forward over each row of `ids` [B, L]: per predicted token t >= prompt, the
    log-prob of ids[t] (log-softmax in float64), the argmax and the gap between the top two logits,
    each [B, L - prompt] (float64 / long)."""
    import torch

    logprobs, best, margins = [], [], []
    head = model.get_output_embeddings()
    with torch.no_grad():
        for row in ids:
            row = row.to(model.device)
            hidden = model.model(input_ids=row[None]).last_hidden_state[0, prompt - 1:-1]
            parts = [[], [], []]
            for start in range(0, len(hidden), chunk):
                logits = head(hidden[start:start + chunk]).double()
                targets = row[prompt + start:prompt + start + chunk]
                parts[0].append(logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0])
                top = logits.topk(2, dim=-1)
                parts[1].append(top.indices[:, 0])
                parts[2].append(top.values[:, 0] - top.values[:, 1])
            for part, values in zip((logprobs, best, margins), parts):
                part.append(torch.cat(values).cpu())
    return torch.stack(logprobs), torch.stack(best), torch.stack(margins)


def errors(values, reference) -> dict:
    gap = (values.double() - reference.double()).abs()
    return {"max": float(gap.max()), "mean": float(gap.mean())}


def generation(engine, prompts: list[list[int]], tokens: int, device: str, repeats: int) -> tuple[list, dict]:
    """Greedy outputs with log-probs (the first call) and the median of `repeats` more calls."""
    import torch

    from aligner_ext.generation.base import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True, return_logprobs=True)
    times, outputs = [], None
    for _ in range(1 + repeats):
        engine.release_memory()
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = engine.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        outputs = outputs or result
    engine.release_memory()  # the next engine's cache takes the memory
    return outputs, {"first_s": times[0], "median_s": statistics.median(times[1:]) if repeats else times[0]}


def rollout_part(model, hf_reference, engines: dict, work: dict, args, model_shape: dict, bandwidth: float) -> dict:
    """Part 2 of the module docstring for each engine of `engines` (name -> engine)."""
    import torch

    rows, prompt, response = work["rollout"]
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(FIRST_WORD_ID, model.config.vocab_size, (rows, prompt), generator=gen).tolist()
    word = 2 if model.dtype == torch.bfloat16 else 4
    bound = decode_bound_s(model_shape, rows, prompt, response, word, bandwidth)
    lifted_shape = {**model_shape, "windows": [None] * len(model_shape["windows"])}
    results = {}
    for name, engine in engines.items():
        outputs, speed = generation(engine, prompts, response, model.device.type, args.repeats)
        ids = torch.tensor([p + o.token_ids for p, o in zip(prompts, outputs)])
        ours = torch.tensor([o.logprobs for o in outputs])
        result = {"tokens_per_s": rows * response / speed["median_s"], **speed}
        windowed = not name.endswith("lifted")
        result["decode_bound_share"] = (bound if windowed else decode_bound_s(lifted_shape, rows, prompt, response,
                                                                              word, bandwidth)) / speed["median_s"]
        if windowed:
            fp32, best, margin = teacher_forced(hf_reference, ids, prompt, work["chunk"])
            bf16, bf16_best, _ = teacher_forced(model, ids, prompt, work["chunk"])
            generated = ids[:, prompt:]
            decided = margin > MARGIN
            result.update(
                logprob_error=errors(ours, fp32), hf_bf16_logprob_error=errors(bf16, fp32),
                argmax_agreement=float((generated == best).double().mean()),
                hf_bf16_argmax_agreement=float((bf16_best == best).double().mean()),
                decided_share=float(decided.double().mean()),
                decided_disagreements=int(((generated != best) & decided).sum()),
                hf_bf16_decided_disagreements=int(((bf16_best != best) & decided).sum()))
        results[name] = result
    return results


def worker(args) -> None:
    import torch
    from grpo_step_lib import build_word_tokenizer
    from transformers import AutoModelForCausalLM

    from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
    from aligner_ext.models.family_configs import family_config
    from aligner_ext.models.megatron.decoder import MegatronGenerationModel

    size = "tiny" if args.tiny else "gpu"
    work = WORK[size]
    window = args.window or work["window"]
    rows, prompt, response = work["train"]
    longest = max(sum(work["train"][1:]), sum(work["rollout"][1:]))
    config = family_config(args.worker, **{**SIZES[size], "sliding_window": window,
                                          "max_position_embeddings": max(longest, SIZES[size]["max_position_embeddings"])})
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model_shape = shape(config)
    result = {"family": args.worker, "window": window, "windows": model_shape["windows"], "work": work,
              "dtype": str(dtype)}
    hardware = json.loads((args.out / "hardware.json").read_text())

    # 1. the training forward's log-probs
    batch = random_batch(rows, prompt, response, config.vocab_size, seed=1)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    reference = copy.deepcopy(model).float().eval()
    fp32 = teacher_forced(reference, ids, prompt, work["chunk"])[0]
    reference.config.sliding_window = LIFTED  # transformers reads it at every forward's mask
    control = teacher_forced(reference, ids, prompt, work["chunk"])[0]
    reference.config.sliding_window = window
    forward = {"transformers": errors(teacher_forced(model, ids, prompt, work["chunk"])[0], fp32),
               "control_window_lifted": errors(control, fp32)}
    preset = Preset(args.worker, "words", config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                    config.num_key_value_heads, config.intermediate_size, config.vocab_size, prompts=rows, n=1,
                    prompt_length=prompt, response_length=response, micro_batch=2, device=device, variant_steps=1)
    policy = megatron_policy(model, preset, args.lr, args.steps * 2 + 2, tokens=work["tokens"])
    forward["megatron_packed"] = errors(policy.logprobs(batch, 1.0)[0], fp32)
    packed_config = policy.cfg
    policy.cfg = dataclasses.replace(packed_config, micro_batch_tokens=0)
    forward["megatron_rows"] = errors(policy.logprobs(batch, 1.0)[0], fp32)
    policy.cfg = packed_config
    result["forward"] = forward
    write_json(args.out / f"{args.worker}.json", result)

    # 2. the rollout engine on both backends' models, and with the windows lifted
    tokenizer = build_word_tokenizer(config.vocab_size)
    settings = RolloutEngineConfig(max_batch_size=work["rollout"][0])
    engines = {"hf_decoder": RolloutEngine(model, tokenizer, settings),
               "megatron_decoder": RolloutEngine(MegatronGenerationModel(policy.core, config, model.generation_config),
                                                 tokenizer, settings)}
    if not args.tiny:
        windowed = model.config
        model.config = copy.deepcopy(windowed)  # the engine reads the windows when it is built
        model.config.sliding_window = None
        engines["hf_decoder_lifted"] = RolloutEngine(model, tokenizer, settings)
        model.config = windowed
    result["rollout"] = rollout_part(model, reference, engines, work, args, model_shape, hardware["copy_bytes_per_s"])
    del engines, reference
    write_json(args.out / f"{args.worker}.json", result)

    # 3. training speed, windowed and lifted
    sequences = [prompt + response] * rows
    training = {}
    for label in ("windowed", "lifted"):
        if label == "lifted":
            for layer in policy.core.decoder.layers:
                layer.self_attention.core_attention.window = None
        calls = megatron_calls(policy, batch, device, args.steps)
        seconds = statistics.median(call["phases_s"]["train"] for call in calls)
        counted = model_shape if label == "windowed" else {**model_shape, "windows": [None] * len(model_shape["windows"])}
        training[label] = {"train_s": seconds, "train_mfu": train_flops(counted, sequences, [response] * rows)
                           / seconds / hardware["matmul_flops_per_s"],
                           "peak_gib": max(call["peak_gib"].get("train", 0.0) for call in calls)}
    result["training"] = training
    write_json(args.out / f"{args.worker}.json", result)


def verdicts(result: dict) -> list[tuple[str, str]]:
    """The module docstring's PASS / FAIL lines of one family's result."""
    lines = []
    forward = result.get("forward", {})
    tolerance = 2 * forward.get("transformers", {}).get("mean", 0.0) + 2e-3
    for name in ("megatron_packed", "megatron_rows"):
        if name in forward:
            ok = forward[name]["mean"] <= tolerance < forward["control_window_lifted"]["mean"]
            lines.append(("PASS" if ok else "FAIL", f"{result['family']} training forward ({name}): mean error "
                          f"{forward[name]['mean']:.2e} within {tolerance:.2e}, control "
                          f"{forward['control_window_lifted']['mean']:.2e} outside it"))
    for name, r in result.get("rollout", {}).items():
        if "logprob_error" not in r:
            continue
        bound = 2 * r["hf_bf16_logprob_error"]["mean"] + 2e-3
        ok = r["logprob_error"]["mean"] <= bound and r["decided_disagreements"] <= r["hf_bf16_decided_disagreements"]
        lines.append(("PASS" if ok else "FAIL", f"{result['family']} rollout {name}: log-prob mean error "
                      f"{r['logprob_error']['mean']:.2e} (within {bound:.2e}), greedy tokens = float32 argmax "
                      f"{r['argmax_agreement']:.1%} (transformers {r['hf_bf16_argmax_agreement']:.1%}), decided "
                      f"disagreements {r['decided_disagreements']} (transformers {r['hf_bf16_decided_disagreements']})"))
    return lines


def render(report: dict) -> str:
    hardware = report["hardware"]
    lines = [f"Sliding windows ({report['date']}, {hardware['device_name']}; copy {hardware['copy_bytes_per_s'] / 1e9:.0f}"
             f" GB/s, {hardware['matmul']} {hardware['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s)", ""]
    for name, result in report["families"].items():
        if "failed" in result:
            lines += [f"{name}: failed, {result['failed']}", ""]
            continue
        train, rollout = result["work"]["train"], result["work"]["rollout"]
        lines += [f"**{name}**, window {result['window']} ({sum(w is not None for w in result['windows'])} of "
                  f"{len(result['windows'])} layers), {result['dtype']}:", "",
                  f"Training forward, {train[0]} x ({train[1]} + {train[2]}) tokens, log-prob error against transformers "
                  "float32 (max / mean):", "", "| computed by | max | mean |", "| --- | --- | --- |"]
        lines += [f"| {key} | {e['max']:.3e} | {e['mean']:.3e} |" for key, e in result.get("forward", {}).items()]
        if result.get("rollout"):
            lines += ["", f"Rollout engine, greedy, {rollout[0]} x ({rollout[1]} + {rollout[2]}) tokens:", "",
                      "| engine | tokens/s | decode bound | log-prob error max / mean (transformers) | greedy = fp32 "
                      "argmax (transformers) | decided disagreements (transformers) |", "| --- " * 6 + "|"]
            for engine, r in result["rollout"].items():
                if "logprob_error" in r:
                    quality = (f"{r['logprob_error']['max']:.3f} / {r['logprob_error']['mean']:.2e} "
                               f"({r['hf_bf16_logprob_error']['max']:.3f} / {r['hf_bf16_logprob_error']['mean']:.2e}) | "
                               f"{r['argmax_agreement']:.1%} ({r['hf_bf16_argmax_agreement']:.1%}) | "
                               f"{r['decided_disagreements']} ({r['hf_bf16_decided_disagreements']}) of "
                               f"{r['decided_share']:.0%} decided")
                else:
                    quality = "- | - | -"
                lines.append(f"| {engine} | {r['tokens_per_s']:,.0f} | {r['decode_bound_share']:.1%} | {quality} |")
        if result.get("training"):
            lines += ["", "Megatron train call (packed):", "", "| attention | s | MFU | peak GiB |", "| --- | --- | --- | --- |"]
            lines += [f"| {label} | {t['train_s']:.3f} | {100 * t['train_mfu']:.1f}% | {t['peak_gib']:.1f} |"
                      for label, t in result["training"].items()]
        lines += [""] + [f"{verdict} {text}" for verdict, text in verdicts(result)] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="gemma3_text,mistral")
    parser.add_argument("--window", type=int, default=None, help="sliding_window (GPU default 512, tiny 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed train calls per attention")
    parser.add_argument("--repeats", type=int, default=2, help="timed generate calls after the first")
    driver_arguments(parser, timeout=300)
    args = parser.parse_args(argv)
    hardware = driver_setup(args, "sliding_window")
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    write_json(args.out / "hardware.json", hardware)
    report = {"date": datetime.date.today().isoformat(), "hardware": hardware, "families": {},
              "command": " ".join(sys.argv[1:] if argv is None else argv)}
    common = ["--out", str(args.out), "--steps", str(args.steps), "--repeats", str(args.repeats), "--lr", str(args.lr)]
    common += (["--window", str(args.window)] if args.window else []) + (["--tiny"] if args.tiny else [])
    failed = False
    for name in [family for family in args.families.split(",") if family]:
        left = min(args.timeout, args.budget - (time.perf_counter() - started))
        result, why = run_worker(name, [sys.executable, __file__, "--worker", name, *common], args.out, left)
        if result is None and (args.out / f"{name}.json").exists():  # stopped after a part: what it wrote
            result = json.loads((args.out / f"{name}.json").read_text())
            result["failed_after"] = why
        report["families"][name] = result or {"failed": why}
        failed |= result is None or any(verdict == "FAIL" for verdict, _ in verdicts(result))
        write_json(args.out / "sliding_window.json", report)
        (args.out / "sliding_window.md").write_text(render(report) + "\n")
    print(render(report))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
