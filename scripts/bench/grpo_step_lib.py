"""What the GRPO-step benchmark's driver and its per-system workers share: the presets, the
workspace (model, tokenizer, prompt rows, log-prob probe) every system reads, the benchmark
reward, and the phase clock that times each phase of a step with its peak memory.

See scripts/bench/grpo_step.py for the benchmark itself.
"""

from __future__ import annotations

import cProfile
import inspect
import json
import pstats
import random
import re
import string
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from common import StepEvents

# Data source of the benchmark rows; both systems score it with `bench_score`.
DATA_SOURCE = "grpo_bench"
FIRST_WORD_ID = 7  # word tokenizer: ids below are specials and role names; random text uses the rest
SOLVED_SHARE = 0.5  # rows whose every response scores 1: their groups all agree (dynamic sampling drops them)
# The long-tailed workload (--long-tail): LONG_SHARE of a step's responses run to R tokens, the others
# stop at R / LONG_FACTOR, the median
LONG_SHARE, LONG_FACTOR = 0.1, 8
# --vary-prompt-widths' draw. At the embedded preset its step widths are 74, 99, 117, 67, 99, 112, 122, 86,
# 125, 112, 78: step 5's (from 0, the warm-up step included) is the first multiple of 16, a step that
# compiled Triton kernels again before widths were padded (aligner_ext/widths.py); step 9's
# is the same width again
WIDTHS_SEED = 6


@dataclass(frozen=True)
class Preset:
    """One benchmark workload: the model shape and the batch of a step."""

    name: str
    architecture: str  # "char": the embedded model's character tokenizer; "words": a synthetic word-level vocabulary
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # "words" only; the character tokenizer has its own
    prompts: int  # prompts per step
    n: int  # samples per prompt
    prompt_length: int  # tokens, chat template included
    response_length: int  # tokens, every response (EOS ignored); under --long-tail the long ones' (LongTail)
    micro_batch: int  # sequences per forward/backward (ours; TRL's fast modes)
    device: str  # "cuda" or "cpu"
    variant_steps: int  # measured steps of each variant run


PRESETS = {
    # The embedded model at Qwen2-0.5B's layer sizes (conf/embedded_size/qwen2_0_5b_layers.yaml), 358M.
    "embedded": Preset("embedded", "char", 896, 24, 14, 2, 4864, 0, prompts=16, n=8, prompt_length=128,
                       response_length=256, micro_batch=64, device="cuda", variant_steps=3),
    # Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 / 2 heads, MLP 8960, tied 151,936 vocabulary).
    "qwen1_5b": Preset("qwen1_5b", "words", 1536, 28, 12, 2, 8960, 151936, prompts=32, n=8, prompt_length=256,
                       response_length=512, micro_batch=16, device="cuda", variant_steps=3),
    # The same at half its prompts: one rank's share of `qwen1_5b` under DP=2, so that one GPU tells what the
    # multi-GPU table's DP=2 row can gain at most (its generation and training less the gradients' all-reduce).
    "qwen1_5b_half": Preset("qwen1_5b_half", "words", 1536, 28, 12, 2, 8960, 151936, prompts=16, n=8,
                            prompt_length=256, response_length=512, micro_batch=16, device="cuda", variant_steps=3),
    # Qwen2.5-3B's shape (hidden 2048, 36 layers, 16 / 2 heads, MLP 11008, tied 151,936 vocabulary): does
    # it train and generate on one GPU (the Megatron backend with the distributed optimizer)?
    "qwen3b": Preset("qwen3b", "words", 2048, 36, 16, 2, 11008, 151936, prompts=16, n=8, prompt_length=256,
                     response_length=512, micro_batch=8, device="cuda", variant_steps=3),
    # The embedded default model (4 layers, hidden 128) for the 2-core CPU run.
    "tiny": Preset("tiny", "char", 128, 4, 4, 2, 512, 0, prompts=4, n=8, prompt_length=48, response_length=64,
                   micro_batch=32, device="cpu", variant_steps=3),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly `vocab_size` entries, needing no download: ChatML specials,
    the three role names, then words `t<id>`; words are split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>", "user", "assistant", "system"]
    assert len(words) == FIRST_WORD_ID
    vocab = {token: index for index, token in enumerate(words)}
    vocab.update({f"t{index}": index for index in range(len(words), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<|unk|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_model_and_tokenizer(preset: Preset):
    """Random weights from a config (seed 0), Llama architecture, tied embeddings."""
    from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer() if preset.architecture == "char" else build_word_tokenizer(preset.vocab_size)
    shape = TinyModelConfig(hidden_size=preset.hidden_size, num_layers=preset.num_layers, num_heads=preset.num_heads,
                            num_kv_heads=preset.num_kv_heads, intermediate_size=preset.intermediate_size,
                            max_position_embeddings=preset.prompt_length + preset.response_length + 512)
    return build_tiny_model(tokenizer, shape), tokenizer


def random_content(preset: Preset, tokenizer, rng: random.Random, tokens: int) -> str:
    if preset.architecture == "char":
        return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(tokens))
    return " ".join(f"t{rng.randrange(FIRST_WORD_ID, preset.vocab_size)}" for _ in range(tokens))


def prompt_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_workspace(preset: Preset, rows_needed: int, directory: Path, seed: int = 0,
                    model_and_tokenizer: tuple | None = None, vary_widths: bool = False) -> dict:
    """The model (safetensors), its tokenizer, `rows.jsonl` and `probe.pt`, written once for every system.
    The model is the preset's (`build_model_and_tokenizer`) unless `model_and_tokenizer` gives one
    (scripts/bench/families.py: each family's).

    Every prompt renders to exactly `preset.prompt_length` tokens (checked), or, `vary_widths`, to the
    lengths `varying_prompt_lengths` draws. Rows carry what every variant reads: a ground truth
    ("solved" for SOLVED_SHARE of them), a rubric of four items and a gold solution (the CPO hint).
    """
    directory.mkdir(parents=True, exist_ok=True)
    model, tokenizer = model_and_tokenizer or build_model_and_tokenizer(preset)
    if preset.device == "cuda":  # every system computes in bf16 there: store the weights it rounds to
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory / "model", safe_serialization=True)
    tokenizer.save_pretrained(directory / "model")
    rng = random.Random(seed)
    overhead = len(prompt_ids(tokenizer, ""))
    lengths = ([preset.prompt_length] * rows_needed if not vary_widths
               else varying_prompt_lengths(preset, rows_needed, overhead + 1))
    rows = []
    for index, length in enumerate(lengths):
        content = random_content(preset, tokenizer, rng, length - overhead)
        if len(prompt_ids(tokenizer, content)) != length:
            raise RuntimeError(f"row {index}: prompt is not {length} tokens")
        rubrics = [{"criterion": f"mentions {random_content(preset, tokenizer, rng, 4)}", "points": points,
                    "tags": []} for points in (5, 3, 2, -2)]
        rows.append({"prompt": [{"role": "user", "content": content}], "data_source": DATA_SOURCE,
                     "reward_model": {"ground_truth": "solved" if rng.random() < SOLVED_SHARE else "open",
                                      "rubrics": rubrics},
                     "extra_info": {"gold_solution": random_content(preset, tokenizer, rng, 32)}})
    with open(directory / "rows.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    # The step-0 log-prob probe: 4 prompts of P tokens (the first rows' where every prompt has P) with
    # random responses of the full length.
    generator = torch.Generator().manual_seed(seed)
    probe_contents = ([row["prompt"][0]["content"] for row in rows[:4]] if not vary_widths else
                      [random_content(preset, tokenizer, rng, preset.prompt_length - overhead) for _ in range(4)])
    probe_prompts = torch.tensor([prompt_ids(tokenizer, content) for content in probe_contents])
    probe_responses = torch.randint(FIRST_WORD_ID, model.config.vocab_size, (4, preset.response_length), generator=generator)
    torch.save({"prompt_ids": probe_prompts, "response_ids": probe_responses}, directory / "probe.pt")
    counts = model_counts(model.config)
    (directory / "preset.json").write_text(json.dumps({"preset": asdict(preset), "model": counts}, indent=2))
    return counts


def varying_prompt_lengths(preset: Preset, rows: int, shortest: int, seed: int = WIDTHS_SEED) -> list[int]:
    """Prompt lengths in tokens whose longest changes every step, as real data's do: per step of
    `preset.prompts` rows, a width drawn from [P / 2, P] other than the step before's, the step's
    first row that long and the others drawn from [width / 4, width] (at least `shortest`)."""
    rng = random.Random(seed)
    lengths, width = [], 0
    while len(lengths) < rows:
        width = rng.choice([w for w in range(max(shortest, preset.prompt_length // 2), preset.prompt_length + 1)
                            if w != width])
        lengths += [width] + [rng.randint(max(shortest, width // 4), width) for _ in range(preset.prompts - 1)]
    return lengths[:rows]


def model_counts(config) -> dict:
    """Parameter and byte counts the floors are computed from. A mixture of experts' body counts the
    parameters a token uses (its top-k experts, the router and any shared expert), and `experts`,
    `top_k`, `expert_params` (one expert's) let the decode bound count the experts a step reads."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_width = config.num_key_value_heads * head_dim
    q_width = config.num_attention_heads * head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    counts = {"layers": layers, "hidden": hidden, "vocab": config.vocab_size, "head_dim": head_dim, "q_width": q_width,
              "head_params": config.vocab_size * hidden,  # the (tied) output projection
              "kv_values_per_token": 2 * layers * kv_width}  # K and V of every layer
    experts = getattr(config, "num_experts", None)
    if not experts:
        counts["body_matmul_params"] = layers * (attention + 3 * hidden * config.intermediate_size)
        return counts
    expert = 3 * hidden * config.moe_intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    active = attention + config.num_experts_per_tok * expert + experts * hidden + (3 * shared + 1) * hidden * bool(shared)
    return {**counts, "body_matmul_params": layers * active, "experts": experts, "top_k": config.num_experts_per_tok,
            "expert_params": expert}


def long_tail_lengths(sequences: int, response_length: int) -> list[int]:
    """The response lengths of one step of the long-tailed workload, longest first: round(LONG_SHARE x
    sequences) of `response_length`, the others of `response_length` // LONG_FACTOR."""
    long = round(LONG_SHARE * sequences)
    return [response_length] * long + [response_length // LONG_FACTOR] * (sequences - long)


class LongTail:
    """An engine's responses made long-tailed (long_tail_lengths), the long ones chosen by the call's
    seed (the sampling seed of its step: the same rows in every system). Random weights never end a
    response, so a call is made as two: every sequence to the median length, then the long ones
    continued to `max_new_tokens` from where they stand (the rollout engine's kept cache resumes them
    without prefilling them again). The decode batch thus narrows after the median as it does when
    most responses end at EOS, and the tail runs alone: what generation ahead can overlap."""

    def __init__(self, engine):
        self.engine, self.generate = engine, engine.generate
        engine.generate = self

    def __call__(self, prompts, params):
        long = sorted(random.Random(params.seed).sample(range(len(prompts)), round(LONG_SHARE * len(prompts))))
        return median_then_tails(self.engine, self.generate, prompts, params, long)


def median_then_tails(engine, generate, prompts, params, long: list[int]):
    """`generate` (`engine`'s) made long-tailed as two calls: every prompt to the median length R / LONG_FACTOR, then
    the `long` ones continued to R from where they stand (the rollout engine's kept cache resumes them without
    prefilling them again)."""
    median = params.max_new_tokens // LONG_FACTOR
    version = engine.weights_version  # of the first part's tokens where its outputs carry none
    outputs = generate(prompts, replace(params, max_new_tokens=median))
    tail_version = engine.weights_version  # a refit between the two parts (partial rollouts) moves it
    tails = generate([list(prompts[index]) + outputs[index].token_ids for index in long],
                     replace(params, max_new_tokens=params.max_new_tokens - median))
    for index, tail in zip(long, tails):
        output = outputs[index]
        if output.versions is not None or tail.versions is not None or tail_version != version:
            output.versions = ((output.versions or [version] * len(output.token_ids))
                               + (tail.versions or [tail_version] * len(tail.token_ids)))
        output.token_ids = output.token_ids + tail.token_ids
        if output.logprobs is not None:
            output.logprobs = output.logprobs + tail.logprobs
        output.finish_reason, output.routing = tail.finish_reason, tail.routing  # the routing of every token
    return outputs


class LongTailByPrompt:
    """The long-tailed workload by prompt, for runs that carry groups over (rollout.carry_over): each prompt is
    long with probability LONG_SHARE, chosen by its tokens, so that a response resumed in a later call (its
    prompt followed by its tokens so far) keeps its length; every response of a long prompt runs to R tokens,
    the others stop at R / LONG_FACTOR. Random weights never end a response: each request is capped at the
    tokens its length leaves, and one that reached its length is reported ended ("stop"). The prompts are
    `prompt_length` tokens (the workspace's), so a request's tokens past them are its response so far; None:
    every request is a prompt alone (a run that carries nothing over, whose prompts' widths may vary). An engine
    that takes no per-request caps (a server's) is called as LongTail calls it: every prompt to R / LONG_FACTOR,
    then the long prompts' responses continued to R (fresh prompts only: carrying groups over needs the rollout
    engine)."""

    def __init__(self, engine, prompt_length: int | None = None):
        self.engine, self.generate, self.prompt_length = engine, engine.generate, prompt_length
        engine.generate = self

    def length(self, prompt: list[int], response_length: int) -> int:
        long = random.Random(repr(prompt[: self.prompt_length])).random() < LONG_SHARE
        return response_length if long else response_length // LONG_FACTOR

    def __call__(self, prompts, params, **engine_options):
        if "caps" not in inspect.signature(self.generate).parameters:  # a server's engine: fresh prompts only
            long = [index for index, prompt in enumerate(prompts)
                    if self.length(prompt, params.max_new_tokens) == params.max_new_tokens]
            return median_then_tails(self.engine, self.generate, prompts, params, long)
        left = [self.length(prompt, params.max_new_tokens) - (len(prompt) - (self.prompt_length or len(prompt)))
                for prompt in prompts]
        caps = engine_options.pop("caps", None) or [params.max_new_tokens] * len(prompts)
        outputs = self.generate(prompts, params, caps=[min(*pair) for pair in zip(left, caps)], **engine_options)
        for output, tokens_left in zip(outputs, left):
            if len(output.token_ids) == tokens_left:
                output.finish_reason = "stop"
        return outputs


# ---- the benchmark reward (both systems) ----

def bench_score(response: str, solved: bool) -> float:
    """1 on a solved row; otherwise the parity of the response's character codes (a fair coin on random text)."""
    return 1.0 if solved else float(sum(map(ord, response)) % 2)


def score(response: str, row):
    """Our reward-function signature (aligner_ext/rewards/base.py)."""
    from aligner_ext.rewards.base import RewardResult

    value = bench_score(response, row.ground_truth == "solved")
    return RewardResult(score=value, correct=value)


def trl_reward(completions, ground_truth, **_):
    """TRL's reward-function signature: conversational completions and the dataset's columns."""
    return [bench_score(completion[0]["content"] if isinstance(completion, list) else completion, truth == "solved")
            for completion, truth in zip(completions, ground_truth)]


# ---- timing ----

class PhaseClock:
    """Wall time and peak memory per phase of a step.

    Phases nest (`push`/`pop`); every boundary synchronises the device, charges the time since the
    last boundary to the innermost open phase (or to `outside` when none is open) and does the same
    with the peak allocated memory, then resets the peak. So phase times are exclusive and add up to
    the step exactly. Each step also records the events that explain a slow one (common.StepEvents).
    """

    def __init__(self, device: str, outside: str = "other", own_stream: bool = False):
        self.cuda = device == "cuda"
        # own_stream: synchronise the calling thread's stream only (generation ahead of training runs in
        # another thread on a stream of its own, which a device-wide synchronise would wait for too)
        self.own_stream = own_stream
        self.outside = outside
        self.stack: list[str] = []
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.last = self._now()
        # every outermost call of a phase named here runs under its own torch.profiler session,
        # summarised (`kernel_summary`) into `profiles[phase]`
        self.profiling: set[str] = set()
        self.profiles: dict[str, list[dict]] = {}
        self.events = StepEvents(self.cuda)

    def _now(self) -> float:
        if self.cuda and self.own_stream:
            torch.cuda.current_stream().synchronize()
        elif self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _boundary(self) -> None:
        now = self._now()
        phase = self.stack[-1] if self.stack else self.outside
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        if self.cuda:
            self.peak_bytes[phase] = max(self.peak_bytes.get(phase, 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        self.last = now

    def push(self, phase: str) -> None:
        self._boundary()
        self.stack.append(phase)

    def pop(self) -> None:
        self._boundary()
        self.stack.pop()

    def wrap(self, owner, method: str, phase: str) -> None:
        """Time every call of `owner.method` as `phase`."""
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            self.push(phase)
            session = start_profile(self.cuda) if phase in self.profiling and len(self.stack) == 1 else None
            try:
                return inner(*args, **kwargs)
            finally:
                if session is not None:
                    session.__exit__(None, None, None)
                self.pop()
                if session is not None:
                    self.profiles.setdefault(phase, []).append(kernel_summary(session))

        setattr(owner, method, timed)

    def take_step(self) -> dict:
        """Close the step: its total, per-phase seconds and peaks; the clock restarts."""
        self._boundary()
        record = {"step_s": sum(self.seconds.values()), "phases_s": dict(self.seconds),
                  "peak_gib": {phase: value / 2**30 for phase, value in self.peak_bytes.items()},
                  "events": self.events.take()}
        self.seconds, self.peak_bytes = {}, {}
        return record


def clock_loop_phases(clock: PhaseClock, parts, generation: tuple) -> None:
    """Time our loop's phases on `clock`: `generation` (owner, method), the rewards, the log-prob pass,
    training and the weight sync, as `parts` (trainer.build's components) run them."""
    clock.wrap(*generation, "generation")
    clock.wrap(parts.rewards, "score", "rewards")
    clock_trainer_phases(clock, parts)


def clock_trainer_phases(clock: PhaseClock, parts) -> None:
    """Time the phases the trainer's thread runs on `clock`: the log-prob pass, training and the weight
    sync (with generation ahead of training, generation and rewards run in another thread)."""
    clock.wrap(parts.policy, "logprobs", "logprobs")
    clock.wrap(parts.policy, "train", "train")
    clock.wrap(parts.policy, "sync_weights", "weight_sync")
    clock.wrap(parts.engine, "update_weights", "weight_sync")


# Kinds of device kernels by name (the first pattern that matches): where a step's device time goes.
KERNEL_KINDS = (
    ("attention", r"flash|fmha|attn|attention|_split_kernel"),
    ("matrix products", r"gemm|nvjet|cutlass|xmma|cublas|splitk"),
    ("norms", r"rms|layer_?norm|rsqrt"),
    ("optimizer", r"multi_tensor|adam"),
    ("other Triton (compiled, Liger)", r"^triton_|_kernel$|^_"),
    ("copies and fills", r"copy|memcpy|memset|cat|fill"),
    ("elementwise (eager)", r"elementwise|vectorized|unrolled"),
    ("reductions (eager)", r"reduce"),
    ("indexing", r"index|scatter|gather|embedding"),
)


def start_profile(cuda: bool):
    """A torch.profiler session (CPU and, on a GPU, CUDA activity), entered."""
    from torch.profiler import ProfilerActivity, profile

    session = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    session.__enter__()
    return session


def device_time_us(event) -> float:
    """A key_averages row's device time (microseconds), whatever this torch calls the field."""
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def kernel_summary(session, top: int = 25, ranges: str | None = None) -> dict:
    """Where a profiled session's device time went: busy seconds, kernels by kind (KERNEL_KINDS) and
    the `top` kernels by name; with `ranges`, for every record_function range whose name starts with
    it the device time of the kernels its thread launched inside (nested ranges counted in each) and
    its span on the device, the device time of each kind of autograd backward node, and the host's
    busiest operators by their own CPU time."""
    averages = session.key_averages()
    own = device_time_us
    device = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and own(e) > 0]
    # a record_function range shows on the device too (its span there): not a kernel
    kernels = [e for e in device if not getattr(e, "is_user_annotation", False)]
    spans = {e.key: own(e) / 1e6 for e in device if getattr(e, "is_user_annotation", False)}
    if not kernels:  # the CPU: operators by their own time
        own = lambda event: event.self_cpu_time_total  # noqa: E731
        kernels = [e for e in averages if own(e) > 0]
    busy = sum(own(e) for e in kernels) / 1e6
    kinds: dict[str, float] = {}
    for event in kernels:
        kind = next((name for name, pattern in KERNEL_KINDS if re.search(pattern, event.key, re.I)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + own(event) / 1e6
    ordered = sorted(kernels, key=own, reverse=True)[:top]
    summary = {"busy_s": busy, "kinds_s": dict(sorted(kinds.items(), key=lambda item: -item[1])),
               "top": [{"name": e.key[:100], "calls": e.count, "s": own(e) / 1e6} for e in ordered]}
    if ranges is not None:
        cpu = [e for e in averages if e.device_type == torch.autograd.DeviceType.CPU and device_time_us(e) > 0]
        # a range's kernels (launched by its own thread: a forward's, not the backward's) and its span on the device
        summary["ranges_s"] = {e.key: device_time_us(e) / 1e6 for e in cpu if e.key.startswith(ranges)}
        summary["spans_s"] = {key: seconds for key, seconds in spans.items() if key.startswith(ranges)}
        busiest = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
                         key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        summary["host_s"] = {e.key[:80]: e.self_cpu_time_total / 1e6 for e in busiest}
        node = "autograd::engine::evaluate_function: "
        summary["backward_s"] = dict(sorted(((e.key.removeprefix(node), device_time_us(e) / 1e6)
                                             for e in cpu if e.key.startswith(node)), key=lambda item: -item[1])[:top])
    return summary


def profiled_step(clock: PhaseClock, phases: str, step, path: Path) -> dict:
    """One more step (`step()`, not a measured one) with each phase of `phases` (comma-separated) under
    torch.profiler: where their device time went, in `path`; the step's record."""
    clock.profiling = set(phases.split(","))
    step()
    record = clock.take_step()
    path.write_text("\n\n".join(
        render_summary(f"{phase} (call {index}, {record['phases_s'].get(phase, 0.0):.3f} s of wall time in the step)",
                       summary) for phase, calls in clock.profiles.items() for index, summary in enumerate(calls)) + "\n")
    return record


def render_summary(title: str, summary: dict) -> str:
    """A `kernel_summary` as text: kinds, then the top kernels, with their shares of the busy time."""
    busy = summary["busy_s"] or 1.0
    lines = [f"{title}: device busy {summary['busy_s']:.4f} s", "  by kind:"]
    lines += [f"    {seconds:9.4f} s {100 * seconds / busy:5.1f}%  {kind}" for kind, seconds in summary["kinds_s"].items()]
    lines.append("  top kernels (calls):")
    lines += [f"    {k['s']:9.4f} s {100 * k['s'] / busy:5.1f}%  {k['name']} ({k['calls']})" for k in summary["top"]]
    for key, label in (("spans_s", "spans on the device (first kernel to last)"),
                       ("ranges_s", "ranges (kernels launched inside, forward only)"),
                       ("backward_s", "backward nodes"), ("host_s", "host: operators by their own CPU time")):
        if summary.get(key):
            lines.append(f"  {label}:")
            lines += [f"    {seconds:9.4f} s {100 * seconds / busy:5.1f}%  {name}" for name, seconds in summary[key].items()]
    return "\n".join(lines)


def write_profile(profiler: cProfile.Profile, path: Path) -> None:
    """The calls that took the most host time, with and without what they called (a first step: where
    its compilation, graph capture and first allocations went)."""
    with open(path, "w") as out:
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("cumulative").print_stats(120)
        stats.sort_stats("tottime").print_stats(40)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2))
