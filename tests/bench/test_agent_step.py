"""The agent-step benchmark (`run.py agents`, scripts/bench/agent_step.py): each turn's new tokens, the
turn-by-turn session's barrier, TRL's turns told apart by their ids, and a small run of our two systems
on the CPU (TRL is not installed in CI; the side by side is in docs/benchmarks.md)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from agent_step_lib import PRESETS  # noqa: E402
from agent_step_ours import EngineLedger, TurnByTurn, new_tokens  # noqa: E402
from agent_step_trl import TOOL_CALL, ForcedToolCalls  # noqa: E402
from run import headline  # noqa: E402

from aligner_ext.agents.tokens import Trajectory  # noqa: E402
from aligner_ext.generation.base import GenerationOutput, SamplingParams  # noqa: E402


def row(*parts: tuple[str, list[int]]) -> Trajectory:
    trajectory = Trajectory([])
    for role, ids in parts:
        trajectory.append(ids, role, "")
    return trajectory


def test_a_turns_new_tokens_are_those_whose_kv_the_episode_has_not_computed():
    first = row(("prompt", [1, 2, 3]), ("sampled", [4, 5]), ("template", [6]), ("observation", [7, 8]),
                ("sampled", [9, 10, 11]))
    # a history rewrite: the next row re-encodes the conversation; it extends what the slot holds
    # ([1 .. 10]: the last sampled id, 11, was never fed back), so only 11, 13, 14 are new
    extending = row(("prompt", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14]), ("sampled", [15]))
    # ... and one that does not extend it: all of its ids
    diverging = row(("prompt", [1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 11, 13]), ("sampled", [15, 16]))
    # turn 1: the prompt; turn 2: the last sampled id 5, the template's 6, the reply's 7 and 8
    assert new_tokens(SimpleNamespace(rows=[first])) == [3, 4]
    assert new_tokens(SimpleNamespace(rows=[first, extending])) == [3, 4, 3]
    assert new_tokens(SimpleNamespace(rows=[first, diverging])) == [3, 4, 12]


class Engine:
    """Records its generate calls; every sequence runs to its cap."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append([list(ids) for ids in prompts])
        self.last_call = {"prefilled_tokens": sum(map(len, prompts)), "prefix_reused_tokens": 1}
        return [GenerationOutput([0] * params.max_new_tokens, "length") for _ in prompts]


def test_turn_by_turn_runs_a_turn_once_every_running_episode_has_submitted_it():
    engine, ledger = Engine(), EngineLedger()
    session = TurnByTurn(engine, SamplingParams(max_new_tokens=2), episodes=3, ledger=ledger)
    session.submit("a", [1], 2, seed=0)
    session.submit("b", [1, 2], 2, seed=1)
    assert not session.busy()  # c's turn is still to come
    session.submit("c", [3], 2, seed=2)
    assert session.busy()
    assert [key for key, _ in session.step()] == ["a", "b", "c"]
    assert engine.calls == [[[1], [1, 2], [3]]] and not session.busy()
    session.release("c")  # c ended: the next turn waits for a and b only
    session.submit("b", [1, 2, 0, 0], 2, seed=1)
    assert not session.busy()
    session.submit("a", [1, 0, 0], 1, seed=0)  # capped by its row's room: a call of its own
    assert [(key, len(output.token_ids)) for key, output in session.step()] == [("b", 2), ("a", 1)]
    assert engine.calls[1:] == [[[1, 2, 0, 0]], [[1, 0, 0]]]
    assert session.stats == {"turns": 5, "prefilled_tokens": 4 + 4 + 3, "reused_tokens": 3}
    assert ledger.first_turn_prefilled == 4  # the first call's


def test_trl_turns_get_a_tool_call_while_their_episode_has_turns_left():
    def parse(tokenizer, ids, prefix=None, tools=None):
        return {"role": "assistant", "content": "text", "tool_calls": ["parsed"]}

    forced = ForcedToolCalls(parse, suffix_length=2)
    forced.start([2, 1, 3])  # episodes 0 and 1 share prompt [1, 1]
    calls = [forced(None, [5], prefix=[1, 1]), forced(None, [6], prefix=[1, 1]), forced(None, [7], prefix=[2, 2])]
    assert [message.get("tool_calls") for message in calls] == [[TOOL_CALL], None, [TOOL_CALL]]
    # TRL's next call continues episodes 0 and 2: prompt + completion + the 2-id tool suffix
    calls = [forced(None, [9], prefix=[1, 1, 5, 8, 8]), forced(None, [10], prefix=[2, 2, 7, 8, 8])]
    assert [message.get("tool_calls") for message in calls] == [None, [TOOL_CALL]]
    assert forced(None, [11], prefix=[2, 2, 7, 8, 8, 10, 8, 8]).get("tool_calls") is None  # its third turn


@pytest.mark.slow
def test_our_two_systems_on_the_cpu(tmp_path):
    preset = PRESETS["tiny"]
    command = [sys.executable, str(BENCH / "run.py"), "agents", "--preset", "tiny", "--systems",
               "ours,ours_turn_by_turn", "--warmup", "0", "--steps", "1", "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    result = json.loads((tmp_path / "result.json").read_text())
    report = result["report"]
    assert report["failures"] == {} and set(report["systems"]) == {"ours", "ours_turn_by_turn"}
    ours, turn_by_turn = report["systems"]["ours"], report["systems"]["ours_turn_by_turn"]
    # equal work: the turns the rows fix, every turn of turn_tokens tokens
    rows = [json.loads(line) for line in (tmp_path / "work" / "rows.jsonl").read_text().splitlines()]
    turns = sum(sum(row["extra_info"]["episode_turns"]) for row in rows[: preset.prompts])
    assert ours["turns_per_step"] == turn_by_turn["turns_per_step"] == [turns]
    assert ours["sampled_tokens_per_step"] == turn_by_turn["sampled_tokens_per_step"] == [turns * preset.turn_tokens]
    # the turn sessions prefill each later turn's new tokens only, and a group's prompt once
    fill = ours["prefill"]
    assert fill["later_prefilled_per_turn"] == fill["later_new_per_turn"] > 0
    assert fill["first_turn_prefilled_per_episode"] == fill["first_turn_new_per_episode"] / preset.n
    assert fill["recomputed"] == fill["evictions"] == 0
    # generate calls turn by turn reuse the kept cache in whole blocks: at least the new tokens
    assert turn_by_turn["prefill"]["later_prefilled_per_turn"] >= turn_by_turn["prefill"]["later_new_per_turn"]
    for name in ("ours", "ours_turn_by_turn"):
        for step in json.loads((tmp_path / f"{name}.json").read_text())["steps"]:
            assert sum(step["phases_s"].values()) == pytest.approx(step["step_s"])
            assert 0 < step["engine_s"] <= step["phases_s"]["generation"]
    assert "| ours_turn_by_turn | " in (tmp_path / "agent_step.md").read_text()
    rows = headline(result)  # docs/benchmarks.md's opening table: a row per system
    assert [what.split(", ")[1] for what, _ in rows] == ["ours", "ours_turn_by_turn"] and "x ours)" in rows[1][1]


def test_the_report_divides_each_system_by_its_prev_counterpart():
    from agent_step import after_before

    def system(step, generation, engine, train):
        return {"step_s": [step, step, step], "phases_s": {"generation": generation, "train": train},
                "engine_s": engine}

    systems = {"ours": system(6.0, 3.0, 2.0, 3.0), "prev:ours": system(8.0, 4.0, 2.5, 3.0),
               "ours_turn_by_turn": system(5.0, 2.0, 1.5, 3.0)}
    lines = after_before(systems)
    # this tree over the earlier one's: 6 / 8, 3 / 4, 2 / 2.5, 3 / 3; a system with no prev: twin has no row
    assert lines[-1] == "| ours | 0.750 | 0.750 | 0.800 | 1.000 |"
    assert not any(line.startswith("| ours_turn_by_turn") for line in lines)
    assert after_before({"ours": systems["ours"]}) == []
