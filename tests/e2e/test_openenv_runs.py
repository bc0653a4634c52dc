"""OpenEnv environments (aligner_ext/agents/openenv_environment.py) against a real openenv-core server on
127.0.0.1 (tests/fixtures/openenv_echo_server.py): the trajectory is what the engine sampled and was given,
the server's rewards are the episode's, a server that raises, hangs or dies costs only its episodes (counted,
one logged line each), and two GRPO steps train on the embedded model."""

import json
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from aligner_ext.agents.openenv_environment import OpenEnvEnvironment
from aligner_ext.config import load_config
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.errors import UserError
from aligner_ext.trainer.loop import train
from tests.e2e.small_run import SMALL_MODEL
from tests.unit.agents.conftest import qwen25_tokenizer  # noqa: F401 - a fixture
from tests.unit.agents.scripted import ScriptedPolicy, run

pytestmark = pytest.mark.slow
SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "openenv_echo_server.py"
STARTUP_S = 120  # importing openenv-core's server (gradio) takes seconds, more on a loaded machine


class EchoServer:
    """The echo server in a process of its own; `url` starts it again if a test made it exit."""

    def __init__(self):
        self.process = None

    @property
    def url(self) -> str:
        if self.process is None or self.process.poll() is not None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
            self.process = subprocess.Popen([sys.executable, str(SERVER), str(self.port)])
            deadline = time.monotonic() + STARTUP_S
            while not self._healthy():
                assert self.process.poll() is None and time.monotonic() < deadline, "the echo server did not start"
                time.sleep(0.1)
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).status == 200
        except OSError:
            return False

    def stop(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def echo_server():
    server = EchoServer()
    yield server
    server.stop()


@pytest.fixture
def echo(echo_server, monkeypatch):
    """The environment name of the echo server (its address in the environment, as a run sees it)."""
    monkeypatch.setenv("E2E_OPENENV_URL", echo_server.url)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return "openenv_environments.Echo"


def draws(*prompts):
    return [PromptDraw(PromptRow(f"row{i}", [{"role": "user", "content": prompt}], "echo"), [], i)
            for i, prompt in enumerate(prompts)]


def answers_the_last_user_message(text, seed):
    """The policy: the content of the conversation's last user message."""
    return text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


def test_an_episode_is_the_servers_session_token_exact_and_scored_by_the_servers_rewards(echo, qwen25_tokenizer):
    replies = iter(["a1", "b22"])
    engine = ScriptedPolicy(qwen25_tokenizer, lambda text, seed: next(replies))
    (outcome,), _ = run(engine, qwen25_tokenizer, draws("say something"), environment=echo)
    assert outcome.end == "done" and outcome.counts["turns"] == 2
    assert outcome.score.score == pytest.approx(1 / 2 + 2 / 3)  # the digits' shares of "a1" and "b22", summed
    (row,) = outcome.rows
    (turn1, _, _), (turn2, _, _) = engine.calls
    assert row.ids[:len(turn1)] == turn1 and row.ids[:len(turn2)] == turn2  # what the engine was given
    end = qwen25_tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [token for token, role in zip(row.ids, row.roles) if role == "sampled"]
    assert sampled == [qwen25_tokenizer.convert_tokens_to_ids(c) for c in "a1"] + [end] + \
        [qwen25_tokenizer.convert_tokens_to_ids(c) for c in "b22"] + [end]  # what it sampled
    # the server's echo is the observation between the turns, in the template's own rendering
    assert qwen25_tokenizer.decode(row.ids[len(turn1):]) == \
        "a1<|im_end|>\n<|im_start|>user\na1<|im_end|>\n<|im_start|>assistant\nb22<|im_end|>"


def test_a_server_that_raises_or_hangs_costs_only_its_episode_counted_with_one_line_each(echo, qwen25_tokenizer, caplog):
    engine = ScriptedPolicy(qwen25_tokenizer, answers_the_last_user_message)
    with caplog.at_level(logging.WARNING, logger="aligner_ext.agents.episodes"):
        outcomes, _ = run(engine, qwen25_tokenizer, draws("7", "raise", "hang", "42"), environment=echo)
    assert [o.end for o in outcomes] == ["done", "environment_error", "environment_error", "done"]
    assert [o.score.score for o in outcomes] == [2.0, 0.0, 0.0, 2.0]  # "7" then "7": all digits, twice
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "row row1" in lines[0] and "asked to raise" in lines[0]
    assert "row row2" in lines[1] and "did not answer step within 2 s" in lines[1]


def test_two_grpo_steps_train_on_the_echo_servers_episodes(echo, tmp_path):
    overrides = ["algorithm.experience_maker=agent_episodes", f"agents.environment={echo}",
                 "agents.limits.max_turns=3", "agents.limits.max_total_tokens=256", "rollout.max_response_length=16",
                 "trainer.tensorboard=false", "trainer.total_steps=2", "trainer.eval.every=0", "data.builtin_val_size=0",
                 "data.train_batch_size=2",
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=echo"]
    train(load_config("base", SMALL_MODEL + overrides))
    steps = [json.loads(line) for line in (tmp_path / "echo" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in steps if r["step"] == 1)
    assert step["batch/num_samples"] == 8 and step["agent/end_done"] == 1.0  # the server ends every episode
    assert step["agent/turns"] == 2.0  # at its second step
    assert step["rollout/logprob_diff_max"] < 1e-4  # the trainer scored the ids the engine sampled


def test_a_server_that_dies_ends_its_episode_counted_with_one_line(echo_server, echo, qwen25_tokenizer, caplog):
    engine = ScriptedPolicy(qwen25_tokenizer, answers_the_last_user_message)
    with caplog.at_level(logging.WARNING, logger="aligner_ext.agents.episodes"):
        (outcome,), _ = run(engine, qwen25_tokenizer, draws("die"), environment=echo)
    assert outcome.end == "environment_error" and outcome.score.score == 0.0
    (line,) = [record.getMessage() for record in caplog.records]
    assert "row row0" in line and "step raised" in line
    assert echo_server.process.wait(timeout=30) == 1  # the server is gone


def test_without_openenv_core_an_openenv_environment_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # importing it raises ImportError
    with pytest.raises(UserError, match=r"pip install 'aligner_ext\[openenv\]'"):
        class Server(OpenEnvEnvironment):
            BASE_URL = "http://127.0.0.1:1"
