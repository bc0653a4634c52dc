"""verifiers 0.4.0 environments (aligner_ext/agents/verifiers_environment.py) written in its style here
(vf_say_digit.py: one turn; vf_add_tool.py: a tool on an MCP server, several turns), loaded by
vf.load_environment and played through our episodes: the trajectory is what the engine sampled and was
given, the task's own rewards score it, a failing environment (a reward that raises, a stop condition that
hangs) costs only its episodes (counted, one logged line each), and two GRPO steps train on the embedded
model. (A server that dies: tests/e2e/test_openenv_runs.py.)"""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner_ext.agents.verifiers_environment import VerifiersEnvironment, completion, wire_message
from aligner_ext.config import load_config
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.errors import UserError
from aligner_ext.trainer.loop import train
from tests.e2e.small_run import SMALL_MODEL
from tests.unit.agents.conftest import qwen25_tokenizer  # noqa: F401 - a fixture
from tests.unit.agents.scripted import ScriptedPolicy, run

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
CALL = '<tool_call>\n{{"name": "add_tools_add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
STARTUP_S = 120  # the tool server imports verifiers: seconds, more on a loaded machine


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """vf_add_tool.py's toolset, served by verifiers' own `Toolset.run` on 127.0.0.1; its MCP address."""
    port_file = tmp_path_factory.mktemp("tools") / "port"
    process = subprocess.Popen([sys.executable, str(HERE / "vf_add_tool.py")],
                               env={**os.environ, "MCP_PORT_FILE": str(port_file), "VF_CONFIG": "{}"})
    deadline = time.monotonic() + STARTUP_S
    while not (port_file.exists() and port_file.read_text()):
        assert process.poll() is None and time.monotonic() < deadline, "the tool server did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port_file.read_text()}/mcp"
    process.kill()
    process.wait()


@pytest.fixture
def tasksets(tool_server, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # verifiers imports a taskset by its module name
    monkeypatch.setenv("E2E_VF_TOOLS_URL", tool_server)


def draws(rows):
    return [PromptDraw(row, [], index) for index, row in enumerate(rows)]


def test_a_single_turn_environment_is_token_exact_and_scored_by_its_own_reward(tasksets, qwen25_tokenizer):
    import vf_say_digit

    rows = vf_say_digit.rows("train", 2, 0)
    digits = [row.messages[-1]["content"][-1] for row in rows]  # "Say the digit d"
    engine = ScriptedPolicy(qwen25_tokenizer, lambda text, seed: text.split("Say the digit ")[-1][0]
                            if text.split("Say the digit ")[-1][0] == digits[0] else "x")
    outcomes, _ = run(engine, qwen25_tokenizer, draws(rows), environment="vf_say_digit:SayDigit")
    assert [o.end for o in outcomes] == ["done", "done"] and [o.counts["turns"] for o in outcomes] == [1, 1]
    assert [o.score.score for o in outcomes] == [1.0, 0.0]  # the digit, then a wrong reply
    for outcome, (given, _, _), reply in zip(outcomes, engine.calls, [digits[0], "x"]):
        (row,) = outcome.rows
        # what the engine was given: the harness's request (its system prompt, then the task's prompt)
        assert row.ids[:len(given)] == given
        assert qwen25_tokenizer.decode(given).endswith(
            f"<|im_start|>system\nAnswer with one digit.<|im_end|>\n<|im_start|>user\n"
            f"{outcome.draw.row.messages[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
        end = qwen25_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert row.ids[len(given):] == [qwen25_tokenizer.convert_tokens_to_ids(reply), end]  # what it sampled
        assert row.roles[len(given):] == ["sampled", "sampled"]


def test_a_tool_environment_runs_the_tool_on_its_server_over_several_turns(tasksets, qwen25_tokenizer):
    import vf_add_tool

    def policy(text, seed):
        """Calls the tool with the question's numbers, then answers its result."""
        if "<tool_response>" not in text:
            a, b = text.split("<|im_start|>user\n")[-1].split("?")[0].split("+")
            return CALL.format(a=a, b=b)
        return text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]

    rows = vf_add_tool.rows("train", 2, 0)
    engine = ScriptedPolicy(qwen25_tokenizer, policy)
    outcomes, _ = run(engine, qwen25_tokenizer, draws(rows), environment="vf_add_tool:AddWithTool")
    for outcome in outcomes:
        a, b = map(int, outcome.draw.row.messages[-1]["content"].rstrip("?").split("+"))
        assert outcome.end == "done" and outcome.counts["turns"] == 2 and outcome.counts["tool_calls"] == 1
        assert outcome.score.score == 1.0  # the task's reward: the last reply is the sum
        (row,) = outcome.rows
        text = qwen25_tokenizer.decode(row.ids)
        assert '"name": "add_tools_add"' in text  # the toolset's schema, as the harness offered it
        assert f"<tool_response>\n{a + b}\n</tool_response>" in text  # computed by the MCP server
        given = [ids for ids, _, _ in engine.calls if row.ids[:len(ids)] == ids]
        assert len(given) == 2  # both turns were given a prefix of the trajectory, never a re-rendering


def test_tool_calls_cross_as_openai_does_arguments_as_json_strings_with_an_id_and_come_back_as_objects():
    ours = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                "function": {"name": "add", "arguments": {"a": 1}}}]}
    (choice,) = completion(ours, turn=3)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [{"id": "call_3_0", "type": "function",
                                                "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert wire_message(choice["message"])["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_a_failing_environment_costs_only_its_episodes_counted_with_one_line_each(tasksets, qwen25_tokenizer, caplog):
    rows = [PromptRow(f"row{i}", [], "verifiers/vf_failing", extra_info={"verifiers_task": task.key})
            for i, task in enumerate(__import__("vf_failing").Failing().env.taskset)]  # fine, raise, hang
    engine = ScriptedPolicy(qwen25_tokenizer, lambda text, seed: "ok")
    with caplog.at_level(logging.WARNING, logger="aligner_ext.agents.episodes"):
        outcomes, _ = run(engine, qwen25_tokenizer, draws(rows), environment="vf_failing:Failing",
                          max_episode_seconds=5)
    assert [o.end for o in outcomes] == ["done", "environment_error", "max_episode_seconds"]
    assert [o.score.score for o in outcomes] == [1.0, 0.0, 0.0]
    lines = sorted(record.getMessage() for record in caplog.records)
    assert len(lines) == 2
    assert "row row1" in lines[0] and "asked to raise" in lines[0]
    assert "row row2" in lines[1] and "max_episode_seconds=5" in lines[1]


@pytest.mark.parametrize("module, environment", [("vf_say_digit", "SayDigit"), ("vf_add_tool", "AddWithTool")])
def test_two_grpo_steps_train_on_a_verifiers_environment(tasksets, tmp_path, module, environment):
    overrides = ["algorithm.experience_maker=agent_episodes", f"agents.environment={module}:{environment}",
                 f"data.builtin_task={module}:rows", "data.builtin_val_size=0", "data.train_batch_size=2",
                 "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256", "rollout.max_response_length=16",
                 "trainer.tensorboard=false", "trainer.total_steps=2", "trainer.eval.every=0",
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=vf"]
    train(load_config("base", SMALL_MODEL + overrides))
    steps = [json.loads(line) for line in (tmp_path / "vf" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in steps if r["step"] == 1)
    assert step["batch/num_samples"] == 8  # 2 prompts x 4 episodes
    assert step["agent/end_environment_error"] == 0.0
    assert step["rollout/logprob_diff_max"] < 1e-4  # the trainer scored the ids the engine sampled


def test_without_verifiers_a_verifiers_environment_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # importing it raises ImportError
    with pytest.raises(UserError, match=r"pip install 'aligner_ext\[verifiers\]'"):
        class Env(VerifiersEnvironment):
            ENV_ID = "anything"
