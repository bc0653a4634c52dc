"""Our side of the agent-step benchmark, in its own process: the agent-episodes maker's whole GRPO step
(`make_experience` + `update_policy`, as `aligner-ext train` runs it) on the rollout engine.

  --mode sessions      the engine's turn sessions: episodes run concurrently, the engine decodes
                       whichever turns wait between their tools, and a turn continues the KV cache
                       its episode's slot kept (the library's path)
  --mode turn_by_turn  the same episode loop and engine without overlap: every running episode's turn t
                       in one `generate` call, then all their tools (concurrently), then turn t + 1
                       (`TurnByTurn` below stands in for the turn session); a call reuses what the
                       engine's prefix cache kept from the last one

  --profile            one more step after the measured ones, its episodes under cProfile: where the host
                       time of the episode loop and the engine went, in <out>.profile.txt
  --torch-profile P    one more step with the phases P (e.g. generation) under torch.profiler: the device's
                       busy time against the wall time, in <out>.torch_profile.txt

Called by scripts/bench/agent_step.py; writes one JSON file.

    python scripts/bench/agent_step_ours.py --workspace DIR --mode sessions --out FILE [--steps 3] [--profile]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

from agent_step_lib import DATA_SOURCE, AgentPreset, read_workspace  # noqa: E402
from grpo_step_lib import PhaseClock, clock_loop_phases, profiled_step, write_json, write_profile  # noqa: E402


def overrides(preset: AgentPreset, lengths: dict, workspace: Path, lr: float, name: str) -> list[str]:
    sequences = preset.prompts * preset.n
    return [
        f"model.path={workspace / 'model'}", f"data.train_files=[{workspace / 'rows.jsonl'}]",
        f"data.train_batch_size={preset.prompts}", f"data.max_prompt_length={lengths['prompt_tokens']}",
        "data.shuffle=false", f"rollout.n={preset.n}", f"rollout.max_response_length={preset.turn_tokens}",
        "rollout.ignore_eos=true", f"+reward.sources.{DATA_SOURCE}=grpo_step_lib:score", "loss.kl_coef=0.0",
        f"policy.device={preset.device}", f"policy.micro_batch_size={preset.micro_batch}", f"policy.optim.lr={lr}",
        "generator.engine=rollout", f"generator.rollout.max_batch_size={sequences}",
        "algorithm.experience_maker=agent_episodes", "agents.environment=agent_step_lib.FixedTurns",
        f"agents.limits.max_turns={preset.max_turns}", f"agents.limits.max_total_tokens={lengths['max_total_tokens']}",
        f"agents.max_concurrent_episodes={sequences}",
        f"trainer.output_dir={workspace / 'runs'}", f"trainer.run_name={name}", "trainer.progress_bar=false",
        "trainer.tensorboard=false",
    ]


class EngineLedger:
    """Per step: the host time spent in the engine's calls (session steps or generate calls; each waits
    for the device work it reads), and the tokens the first turns prefilled."""

    def __init__(self):
        self.engine_s = 0.0
        self.first_turn_prefilled: int | None = None
        self.outcomes: list = []
        self.session: Counter = Counter()

    def take(self) -> dict:
        record = episode_counts(self.outcomes, self.session, self.first_turn_prefilled)
        record["engine_s"] = self.engine_s
        self.__init__()
        return record


class TurnByTurn:
    """A turn session without overlap: it holds the submitted turns until every episode still running
    has submitted one, then runs them all as one `generate` call (`step`; so each turn waits for the
    slowest tool of the one before). The loop's interface (agents/sessions.py); stats as the engine reports
    its calls (prefilled, and reused from the prefix cache the last call kept)."""

    def __init__(self, engine, params, episodes: int, ledger: EngineLedger):
        self.engine, self.params, self.running, self.ledger = engine, params, episodes, ledger
        self.waiting: list[tuple] = []
        self.stats: Counter[str] = Counter()

    def submit(self, key, ids: list[int], max_new_tokens: int, seed: int) -> None:
        self.waiting.append((key, list(ids), max_new_tokens, seed))

    def busy(self) -> bool:
        return bool(self.waiting) and len(self.waiting) == self.running

    def step(self) -> list:
        """Every waiting turn: one call per turn cap (one call unless a turn is capped by what is left of
        its row's max_total_tokens, which the workload leaves room for)."""
        turns, self.waiting = self.waiting, []
        done, prefilled = [], 0
        for cap in sorted({cap for _, _, cap, _ in turns}, reverse=True):
            group = [turn for turn in turns if turn[2] == cap]
            params = dataclasses.replace(self.params, max_new_tokens=cap, seed=group[0][3])
            started = time.perf_counter()
            outputs = self.engine.generate([ids for _, ids, _, _ in group], params)
            self.ledger.engine_s += time.perf_counter() - started
            call = self.engine.last_call
            prefilled += call["prefilled_tokens"]
            self.stats.update(turns=len(group), prefilled_tokens=call["prefilled_tokens"],
                              reused_tokens=call["prefix_reused_tokens"])
            done += [(key, output) for (key, _, _, _), output in zip(group, outputs)]
        if self.ledger.first_turn_prefilled is None:
            self.ledger.first_turn_prefilled = prefilled
        return done

    def release(self, key) -> None:
        self.running -= 1

    def close(self) -> None:
        """Nothing to free: the engine's own calls free their caches."""


def timed_sessions(engine, ledger: EngineLedger) -> None:
    """Time every step of the engine's turn sessions; note what the first step (every episode's first
    turn, admitted together) prefilled."""
    open_session = engine.open_session

    def opened(*args):
        session = open_session(*args)
        step = session.step

        def timed_step():
            started = time.perf_counter()
            done = step()
            ledger.engine_s += time.perf_counter() - started
            if ledger.first_turn_prefilled is None:
                ledger.first_turn_prefilled = session.prefilled_tokens
            return done

        session.step = timed_step
        return session

    engine.open_session = opened


def turn_inputs(outcome) -> list[tuple[list[int], list[int]]]:
    """(the ids a turn continued, the ids it sampled) for every turn of an episode, in order."""
    turns = []
    for row in outcome.rows:
        start = None
        for position, role in enumerate([*row.roles, "end"]):
            if role == "sampled" and start is None:
                start = position
            elif role != "sampled" and start is not None:
                turns.append((row.ids[:start], row.ids[start:position]))
                start = None
    return turns


def new_tokens(outcome) -> list[int]:
    """Per turn of an episode, the ids whose K/V the episode has not computed yet: all of the first
    turn's; after that, what its ids add to those the last turn read and sampled but the last (sampled,
    never fed back): that token, the template's boundary and the tool's reply (all its ids when they do
    not extend those, as after a history rewrite that re-encodes the conversation)."""
    counts, held = [], []
    for ids, sampled in turn_inputs(outcome):
        counts.append(len(ids) - len(held) if held and ids[: len(held)] == held else len(ids))
        held = ids + sampled[:-1]
    return counts


def episode_counts(outcomes: list, session: Counter, first_turn_prefilled: int | None) -> dict:
    """What a step's episodes did: turns, sampled tokens, and the tokens prefilled against the new ones
    (`new_tokens`); the first turns apart, since a group's episodes share their prompt."""
    rows = [row for outcome in outcomes for row in outcome.rows]
    per_episode = [new_tokens(outcome) for outcome in outcomes]
    prompts = {outcome.draw.draw_id: outcome.rows[0].prompt_length() for outcome in outcomes if outcome.rows}
    prefilled = session.get("prefilled_tokens", 0)
    return {
        "episodes": len(outcomes), "turns": sum(map(len, per_episode)),
        "sampled_tokens": sum(row.roles.count("sampled") for row in rows),
        "trained_tokens": sum(len(row.ids) for row in rows), "history_rewrites": len(rows) - len(outcomes),
        "first_turn_new": sum(counts[0] for counts in per_episode if counts),
        "first_turn_distinct_prompts": sum(prompts.values()), "first_turn_prefilled": first_turn_prefilled or 0,
        "later_turns": sum(len(counts) - 1 for counts in per_episode if counts),
        "later_new": sum(sum(counts[1:]) for counts in per_episode),
        "later_prefilled": prefilled - (first_turn_prefilled or 0), "prefilled": prefilled,
        "reused": session.get("reused_tokens", 0), "recomputed": session.get("recomputed_tokens", 0),
        "evictions": session.get("evictions", 0), "decode_steps": session.get("decode_steps"),  # turn sessions'
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("sessions", "turn_by_turn"), required=True)
    parser.add_argument("--system", required=True, help="the name reported")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--profile", action="store_true", help="one more step's episodes under cProfile")
    parser.add_argument("--torch-profile", default="", help="phases of one more step under torch.profiler")
    args = parser.parse_args()

    import torch

    from aligner_ext.config import load_config
    from aligner_ext.trainer.build import build_components
    from aligner_ext.trainer.loop import update_policy
    from aligner_ext.trainer.metrics import StageTimer

    preset, lengths = read_workspace(args.workspace)
    settings = overrides(preset, lengths, args.workspace, args.lr, args.system.replace(":", "_"))
    cfg = load_config("base", settings)
    torch.manual_seed(cfg.trainer.seed)
    parts = build_components(cfg, args.workspace / "runs" / cfg.trainer.run_name)
    ledger = EngineLedger()
    if args.mode == "turn_by_turn":
        engine, episodes = parts.engine, preset.prompts * preset.n
        engine.open_session = lambda params, max_length, max_episodes: TurnByTurn(engine, params, episodes, ledger)
    else:
        timed_sessions(parts.engine, ledger)
    runner = parts.maker.runner
    run = runner.run

    def recorded(*run_args):
        ledger.outcomes, ledger.session = run(*run_args)
        return ledger.outcomes, ledger.session

    runner.run = recorded
    startup_s = time.perf_counter() - STARTED
    clock = PhaseClock(preset.device)
    clock_loop_phases(clock, parts, (runner, "run"))  # generation: the episodes, every turn and tool call
    steps = []

    def report() -> None:  # after every step: a worker stopped at its time limit keeps the steps it finished
        write_json(args.out, {"system": args.system, "startup_s": startup_s, "warmup_steps": args.warmup,
                              "steps": steps, "settings": {"overrides": settings, "mode": args.mode, "policy_dtype":
                                                           str(next(parts.generation_model.parameters()).dtype)}})

    for step in range(args.warmup + args.steps):
        batch, metrics = parts.maker.make_experience(parts.train_loader, step)
        metrics.update(update_policy(parts, batch, StageTimer(), cfg.rollout.temperature))
        record = clock.take_step()
        record.update(ledger.take())
        record["ended_at_s"] = time.perf_counter() - STARTED
        record["metrics"] = {key: float(value) for key, value in metrics.items()
                             if key.startswith("agent/") and isinstance(value, (int, float))}
        steps.append(record)
        report()
    extra_step = args.warmup + args.steps  # the profiled steps come after the measured ones (report() wrote those)
    if args.profile:
        profiler = cProfile.Profile()
        run_traced = runner.run

        def profiled(*run_args):
            profiler.enable()
            try:
                return run_traced(*run_args)
            finally:
                profiler.disable()

        runner.run = profiled
        parts.maker.make_experience(parts.train_loader, extra_step)
        runner.run = run_traced
        write_profile(profiler, args.out.with_suffix(".profile.txt"))
        clock.take_step()
        ledger.take()
        extra_step += 1
    if args.torch_profile:
        record = profiled_step(clock, args.torch_profile,
                               lambda: parts.maker.make_experience(parts.train_loader, extra_step),
                               args.out.with_suffix(".torch_profile.txt"))
        print(f"[{args.system}] profiled step: {record['step_s']:.2f} s", flush=True)
        print(f"[{args.system}] step {step}: {record['step_s']:.2f} s, engine {record['engine_s']:.2f} s, "
              f"{record['turns']} turns, prefilled {record['prefilled']} (later turns {record['later_prefilled']} "
              f"against {record['later_new']} new) " + " ".join(f"{k}={v:.2f}" for k, v in sorted(record["phases_s"].items())),
              flush=True)
    parts.rewards.close()


if __name__ == "__main__":
    main()
