"""What the agent-step benchmark's driver and its workers share: the presets, the workspace (model,
tokenizer with Qwen2.5's chat template, prompt rows fixing each episode's turn count), the tool and
the environment every system's episodes talk to.

See scripts/bench/agent_step.py for the benchmark itself.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_step_lib import FIRST_WORD_ID, build_word_tokenizer
from transformers.utils import get_json_schema

from aligner_ext.agents.environment import Environment, Episode, StepResult

DATA_SOURCE = "agent_bench"  # rows scored by grpo_step_lib.score (ours) and trl_reward (TRL)
TOOL_LATENCY_S = 0.05  # each tool call waits this long
OBSERVATION = " ".join(f"t{FIRST_WORD_ID + index}" for index in range(16))  # the tool's reply: 16 words
TEMPLATE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "chat_templates" / "qwen2_5.jinja"


@dataclass(frozen=True)
class AgentPreset:
    """One workload: the model shape and a step's episodes."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # words of the synthetic word-level tokenizer (grpo_step_lib.build_word_tokenizer)
    prompts: int  # prompts per step (G)
    n: int  # episodes per prompt
    prompt_words: int  # random words of each user message
    turn_tokens: int  # tokens of every model turn (EOS ignored)
    min_turns: int  # each episode's turn count, drawn from [min_turns, max_turns] per row and copy (seeded)
    max_turns: int
    micro_batch: int  # sequences per forward/backward
    device: str  # "cuda" or "cpu"


PRESETS = {
    # Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 / 2 heads, MLP 8960, tied 151,936 vocabulary)
    "qwen1_5b": AgentPreset("qwen1_5b", 1536, 28, 12, 2, 8960, 151936, prompts=16, n=8, prompt_words=128,
                            turn_tokens=128, min_turns=3, max_turns=5, micro_batch=16, device="cuda"),
    # a 4-layer model of hidden 128 for the 2-core CPU: seconds per step
    "tiny": AgentPreset("tiny", 128, 4, 4, 2, 512, 512, prompts=2, n=4, prompt_words=16, turn_tokens=8,
                        min_turns=3, max_turns=5, micro_batch=8, device="cpu"),
}


async def lookup() -> str:
    """Look the answer up.

    The benchmark's tool: it answers after TOOL_LATENCY_S with the same observation, whatever was asked
    (random weights never write a real call).
    """
    await asyncio.sleep(TOOL_LATENCY_S)
    return OBSERVATION


def tool_message(content: str) -> dict:
    return {"role": "tool", "name": "lookup", "content": content}


class FixedTurns(Environment):
    """Episodes of the turn count their row fixes: `extra_info.episode_turns[copy]` model turns, each but
    the last answered by `lookup` (its 50 ms included), the last one ends the episode. The text is
    ignored. The copy is the episode's place in its group: the loop resets a draw's n episodes in order,
    so the k-th reset of a row (mod n) is copy k, as TRL's k-th repetition of the row is."""

    def __init__(self):
        self.resets: Counter[str] = Counter()
        self.schemas = [get_json_schema(lookup)]

    async def reset(self, row) -> Episode:
        turns = row.extra_info["episode_turns"]
        copy = self.resets[row.row_id] % len(turns)
        self.resets[row.row_id] += 1
        return Episode([dict(message) for message in row.messages], self.schemas, {"turns": turns[copy], "taken": 0})

    async def step(self, assistant_message: dict, state: dict) -> StepResult:
        state["taken"] += 1
        if state["taken"] >= state["turns"]:
            return StepResult(done=True)
        return StepResult([tool_message(await lookup())])


def build_tokenizer(preset: AgentPreset):
    """The word-level tokenizer with Qwen2.5's chat template (tools, `<tool_call>`, `<tool_response>`)."""
    tokenizer = build_word_tokenizer(preset.vocab_size)
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def write_workspace(preset: AgentPreset, steps: int, directory: Path, seed: int = 0) -> dict:
    """The model (random weights, bf16 on a GPU), its tokenizer, `rows.jsonl` (`steps` x prompts rows,
    each with its episodes' turn counts) and `agent_preset.json`: the preset and the lengths every
    system sizes itself by (prompt tokens as rendered with the tool, the tool reply's tokens, the
    longest episode)."""
    import torch

    from aligner_ext.agents.tokens import ChatRenderer
    from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(preset)
    rng = random.Random(seed)
    rows = []
    for index in range(preset.prompts * steps):
        content = " ".join(f"t{rng.randrange(FIRST_WORD_ID, preset.vocab_size)}" for _ in range(preset.prompt_words))
        turns = [rng.randint(preset.min_turns, preset.max_turns) for _ in range(preset.n)]
        rows.append({"prompt": [{"role": "user", "content": content}], "data_source": DATA_SOURCE,
                     "reward_model": {"ground_truth": "solved" if index % 2 else "open"},
                     "extra_info": {"episode_turns": turns}})
    with open(directory / "rows.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    # lengths from the renderer our episodes use: the prompt with the tool's schema, one turn's growth
    renderer = ChatRenderer(tokenizer, FixedTurns().schemas)
    trajectory = renderer.start(rows[0]["prompt"])
    prompt_tokens = len(trajectory.ids)
    sampled = [FIRST_WORD_ID] * preset.turn_tokens
    text = tokenizer.decode(sampled, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    renderer.add_turn(trajectory, sampled, {"role": "assistant", "content": text})
    extension = renderer.add_messages(trajectory, [tool_message(OBSERVATION)])
    per_reply = len(extension.template_ids) + len(extension.observation_ids)
    longest = prompt_tokens + preset.max_turns * preset.turn_tokens + (preset.max_turns - 1) * per_reply
    positions = -(-(longest + 64) // 256) * 256
    model = build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=preset.hidden_size, num_layers=preset.num_layers, num_heads=preset.num_heads,
        num_kv_heads=preset.num_kv_heads, intermediate_size=preset.intermediate_size, max_position_embeddings=positions))
    if preset.device == "cuda":  # every system computes in bf16 there: store the weights it rounds to
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory / "model", safe_serialization=True)
    tokenizer.save_pretrained(directory / "model")
    lengths = {"prompt_tokens": prompt_tokens, "reply_tokens": per_reply, "max_total_tokens": longest + 32,
               "positions": positions, "params": sum(p.numel() for p in model.parameters())}
    (directory / "agent_preset.json").write_text(json.dumps({"preset": asdict(preset), "lengths": lengths}, indent=2))
    return lengths


def read_workspace(directory: Path) -> tuple[AgentPreset, dict]:
    saved = json.loads((directory / "agent_preset.json").read_text())
    return AgentPreset(**saved["preset"]), saved["lengths"]
