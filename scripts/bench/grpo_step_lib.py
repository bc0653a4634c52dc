"""What the GRPO-step benchmark's driver and its per-system workers share: the presets, the
workspace (model, tokenizer, prompt rows, log-prob probe) every system reads, the benchmark
reward, and the phase clock that times each phase of a step with its peak memory.

See scripts/bench/grpo_step.py for the benchmark itself.
"""

from __future__ import annotations

import json
import random
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Data source of the benchmark rows; both systems score it with `bench_score`.
DATA_SOURCE = "grpo_bench"
FIRST_WORD_ID = 7  # word tokenizer: ids below are specials and role names; random text uses the rest
SOLVED_SHARE = 0.5  # rows whose every response scores 1: their groups all agree (dynamic sampling drops them)


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
    response_length: int  # tokens, every response (EOS ignored)
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
                    model_and_tokenizer: tuple | None = None) -> dict:
    """The model (safetensors), its tokenizer, `rows.jsonl` and `probe.pt`, written once for every system.
    The model is the preset's (`build_model_and_tokenizer`) unless `model_and_tokenizer` gives one
    (scripts/bench/families.py: each family's).

    Every prompt renders to exactly `preset.prompt_length` tokens (checked). Rows carry what every
    variant reads: a ground truth ("solved" for SOLVED_SHARE of them), a rubric of four items and a
    gold solution (the CPO hint).
    """
    directory.mkdir(parents=True, exist_ok=True)
    model, tokenizer = model_and_tokenizer or build_model_and_tokenizer(preset)
    if preset.device == "cuda":  # every system computes in bf16 there: store the weights it rounds to
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory / "model", safe_serialization=True)
    tokenizer.save_pretrained(directory / "model")
    rng = random.Random(seed)
    overhead = len(prompt_ids(tokenizer, ""))
    rows = []
    for index in range(rows_needed):
        content = random_content(preset, tokenizer, rng, preset.prompt_length - overhead)
        if len(prompt_ids(tokenizer, content)) != preset.prompt_length:
            raise RuntimeError(f"row {index}: prompt is not {preset.prompt_length} tokens")
        rubrics = [{"criterion": f"mentions {random_content(preset, tokenizer, rng, 4)}", "points": points,
                    "tags": []} for points in (5, 3, 2, -2)]
        rows.append({"prompt": [{"role": "user", "content": content}], "data_source": DATA_SOURCE,
                     "reward_model": {"ground_truth": "solved" if rng.random() < SOLVED_SHARE else "open",
                                      "rubrics": rubrics},
                     "extra_info": {"gold_solution": random_content(preset, tokenizer, rng, 32)}})
    with open(directory / "rows.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    # The step-0 log-prob probe: 4 of the prompts with random responses of the full length.
    generator = torch.Generator().manual_seed(seed)
    probe_prompts = torch.tensor([prompt_ids(tokenizer, row["prompt"][0]["content"]) for row in rows[:4]])
    probe_responses = torch.randint(FIRST_WORD_ID, model.config.vocab_size, (4, preset.response_length), generator=generator)
    torch.save({"prompt_ids": probe_prompts, "response_ids": probe_responses}, directory / "probe.pt")
    counts = model_counts(model.config)
    (directory / "preset.json").write_text(json.dumps({"preset": asdict(preset), "model": counts}, indent=2))
    return counts


def model_counts(config) -> dict:
    """Parameter and byte counts the floors are computed from."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_width = config.num_key_value_heads * head_dim
    q_width = config.num_attention_heads * head_dim
    per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * config.intermediate_size
    return {
        "layers": layers, "hidden": hidden, "vocab": config.vocab_size, "head_dim": head_dim,
        "body_matmul_params": layers * per_layer,  # q, k, v, o and the SwiGLU MLP of every layer
        "head_params": config.vocab_size * hidden,  # the (tied) output projection
        "kv_values_per_token": 2 * layers * kv_width,  # K and V of every layer
    }


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
    the step exactly.
    """

    def __init__(self, device: str, outside: str = "other"):
        self.cuda = device == "cuda"
        self.outside = outside
        self.stack: list[str] = []
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
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
            try:
                return inner(*args, **kwargs)
            finally:
                self.pop()

        setattr(owner, method, timed)

    def take_step(self) -> dict:
        """Close the step: its total, per-phase seconds and peaks; the clock restarts."""
        self._boundary()
        record = {"step_s": sum(self.seconds.values()), "phases_s": dict(self.seconds),
                  "peak_gib": {phase: value / 2**30 for phase, value in self.peak_bytes.items()}}
        self.seconds, self.peak_bytes = {}, {}
        return record


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2))
