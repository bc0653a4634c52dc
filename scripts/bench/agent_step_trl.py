"""TRL's side of the agent-step benchmark, in its own process: GRPOTrainer with its tool loop
(`tools=[lookup]`) on the same episodes.

TRL's tool loop (trl/trainer/grpo_trainer.py, `_tool_call_loop`, TRL 1.16) runs without vLLM: each
turn is one `_generate_single_turn` call, on vLLM when `use_vllm`, else transformers' `generate`
(mode `fast`: bf16 weights, no gradient checkpointing, the preset's micro-batch) or its continuous
batching `generate_batch` (mode `cb`). It is turn-synchronous: the episodes whose last turn parsed to
tool calls are continued together in the next call, each from its whole ids (no KV cache is kept
between turns), after the tools of every one of them ran, one episode after another (a plain tool is
called in a loop over the episodes, an async one awaited per episode).

Same work as ours: each turn exactly `turn_tokens` tokens (`generation_kwargs` max_new_tokens and
min_new_tokens; `eos_token_id=-1` under continuous batching, which drops min_new_tokens), and each
episode the turn count its row fixes. TRL continues an episode while its last turn parses to a tool
call, and random weights never write one, so `ForcedToolCalls` adds a call of `lookup` to each
parsed turn while its episode has turns left (the tool itself runs as TRL runs it: 50 ms each).
TRL appends the tool's reply right after the sampled ids (no `<|im_end|>` after a turn cut at its
length), one token fewer per reply than our template boundary.

Called by scripts/bench/agent_step.py; writes one JSON file.

    python scripts/bench/agent_step_trl.py --workspace DIR --mode fast --out FILE [--steps 3]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from agent_step_lib import OBSERVATION, AgentPreset, lookup, read_workspace, tool_message  # noqa: E402
from grpo_step_lib import PhaseClock, trl_reward, write_json  # noqa: E402
from grpo_step_trl import install_phase_clock  # noqa: E402

TOOL_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {}}}


def trl_config(preset: AgentPreset, lengths: dict, mode: str, workspace: Path, steps: int, lr: float):
    from trl import GRPOConfig

    sequences = preset.prompts * preset.n
    turn = {"max_new_tokens": preset.turn_tokens}
    turn.update({"eos_token_id": -1} if mode == "cb" else {"min_new_tokens": preset.turn_tokens})
    settings = dict(
        output_dir=str(workspace / "runs" / f"trl_{mode}"), max_steps=steps,
        per_device_train_batch_size=preset.micro_batch, gradient_accumulation_steps=sequences // preset.micro_batch,
        num_generations=preset.n, max_completion_length=lengths["max_total_tokens"] - lengths["prompt_tokens"],
        learning_rate=lr, lr_scheduler_type="constant", beta=0.0, num_iterations=1, temperature=1.0, top_p=1.0,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True, shuffle_dataset=False,
        gradient_checkpointing=False, generation_kwargs=turn,
    )
    if preset.device == "cpu":
        settings.update(use_cpu=True, bf16=False)  # no bf16 autocast on the CPU: float32 like ours
    else:
        settings.update(model_init_kwargs={"dtype": "bfloat16"})
    if mode == "cb":
        settings.update(use_transformers_continuous_batching=True)
    return GRPOConfig(**settings), settings


class ForcedToolCalls:
    """TRL's `parse_response` with a call of `lookup` added while the turn's episode has turns left.

    Episodes are known by their ids: a first turn (prefix = the prompt) is the next episode of the
    batch in order; a later turn's prefix is the ids after the episode's last turn plus TRL's tool
    suffix (`suffix_length` ids, the same for every reply)."""

    def __init__(self, parse, suffix_length: int):
        self.parse, self.suffix_length = parse, suffix_length
        self.turns: list[int] = []  # per episode of the batch: its turn count
        self.after: dict[tuple[int, ...], tuple[int, int]] = {}  # ids after an episode's last turn -> (episode, turns)
        self.started = 0

    def start(self, turns: list[int]) -> None:
        self.turns, self.after, self.started = turns, {}, 0

    def __call__(self, tokenizer, ids, prefix=None, tools=None) -> dict:
        message = self.parse(tokenizer, ids, prefix=prefix, tools=tools)
        found = self.after.pop(tuple(prefix[: len(prefix) - self.suffix_length]), None)
        if found is None:
            found = (self.started, 0)
            self.started += 1
        episode, taken = found[0], found[1] + 1
        self.after[tuple(prefix) + tuple(ids)] = (episode, taken)
        message.pop("tool_calls", None)
        if taken < self.turns[episode]:
            message["tool_calls"] = [TOOL_CALL]
        return message


class GenerationLedger:
    """Per step: TRL's generation calls (one per turn), their host time, rows, the ids each prefilled
    (every row's whole ids: no cache is kept between turns; padded to the longest row under `generate`)
    and the ids it sampled."""

    def __init__(self, suffix_length: int):
        self.suffix_length = suffix_length
        self.calls: list[dict] = []

    def wrap(self, trainer) -> None:
        generate = trainer._generate_single_turn

        def counted(prompt_ids, *args, **kwargs):
            started = time.perf_counter()
            completion_ids, logprobs = generate(prompt_ids, *args, **kwargs)
            self.calls.append({"s": time.perf_counter() - started, "rows": len(prompt_ids),
                               "prefilled": sum(map(len, prompt_ids)),
                               "padded": len(prompt_ids) * max(map(len, prompt_ids), default=0),
                               "sampled": sum(map(len, completion_ids))})
            return completion_ids, logprobs

        trainer._generate_single_turn = counted

    def take(self) -> dict:
        """The step's counts, named as our worker's; a later turn's new ids are the last sampled one
        and the tool suffix."""
        calls, self.calls = self.calls, []
        first, later = calls[:1], calls[1:]
        rows = sum(call["rows"] for call in calls)
        return {
            "engine_s": sum(call["s"] for call in calls), "generate_calls": len(calls),
            "episodes": sum(call["rows"] for call in first), "turns": rows,
            "sampled_tokens": sum(call["sampled"] for call in calls),
            "first_turn_new": sum(call["prefilled"] for call in first),
            "first_turn_prefilled": sum(call["prefilled"] for call in first),
            "later_turns": rows - sum(call["rows"] for call in first),
            "later_new": sum(call["rows"] for call in later) * (self.suffix_length + 1),
            "later_prefilled": sum(call["prefilled"] for call in later),
            "prefilled": sum(call["prefilled"] for call in calls), "padded_prefill": sum(call["padded"] for call in calls),
            "reused": 0, "recomputed": 0, "evictions": 0,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("fast", "cb"), required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()

    import trl
    import trl.trainer.grpo_trainer as grpo_trainer
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    preset, lengths = read_workspace(args.workspace)
    rows = [json.loads(line) for line in (args.workspace / "rows.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"],
                                  "episode_turns": row["extra_info"]["episode_turns"]} for row in rows])
    config, settings = trl_config(preset, lengths, args.mode, args.workspace, args.warmup + args.steps, args.lr)
    tokenizer = AutoTokenizer.from_pretrained(args.workspace / "model")
    trainer = GRPOTrainer(model=str(args.workspace / "model"), reward_funcs=trl_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, tools=[lookup])
    suffix_length = len(trainer._get_tool_suffix_ids([tool_message(OBSERVATION)]))
    forced = ForcedToolCalls(grpo_trainer.parse_response, suffix_length)
    grpo_trainer.parse_response = forced
    generate_and_score = trainer._generate_and_score_completions

    def with_turn_counts(inputs):
        forced.start([x["episode_turns"][index % preset.n] for index, x in enumerate(inputs)])
        return generate_and_score(inputs)

    trainer._generate_and_score_completions = with_turn_counts
    ledger = GenerationLedger(suffix_length)
    ledger.wrap(trainer)
    startup_s = time.perf_counter() - STARTED
    steps: list = []

    def report() -> None:
        write_json(args.out, {
            "system": f"trl_{args.mode}", "startup_s": startup_s, "warmup_steps": args.warmup, "steps": steps,
            "settings": {"trl": trl.__version__, "GRPOConfig": settings, "tool_suffix_ids": suffix_length,
                         "weights_dtype": str(next(trainer.model.parameters()).dtype),
                         "generation": "transformers generate_batch (continuous batching)" if args.mode == "cb"
                         else "transformers generate"},
        })

    clock = PhaseClock(preset.device)
    install_phase_clock(trainer, clock, steps, report)
    clock.wrap(trainer, "_generate", "generation")  # every turn and every tool call

    class LedgerCallback(TrainerCallback):  # after install_phase_clock's, which appends the step's record
        def on_step_end(self, args, state, control, **kwargs):
            steps[-1].update(ledger.take())

    trainer.add_callback(LedgerCallback())
    trainer.train()
    report()


if __name__ == "__main__":
    main()
