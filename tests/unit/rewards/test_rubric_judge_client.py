"""The OpenAI-compatible judge client and the judge grader, against a local HTTP server started here on
127.0.0.1: requests, caching, retries, no retry on 401, the API key never leaking, a down endpoint,
a slow endpoint, the concurrency limit, configuration from the run config, and a reward worker."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from aligner_ext.config import load_config
from aligner_ext.data.tasks.rubric_qa import rubric_and_gold
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import REWARDS
from aligner_ext.rewards.judge_client import JudgeClient, JudgeConfig, JudgeError, JudgeUnavailable
from aligner_ext.rewards.manager import RewardConfig, RewardManager
from aligner_ext.rewards.rubric import RubricConfig, RubricReward, judge_metrics, parse_verdict

ASK = [{"role": "user", "content": "grade this"}]


def chat(content):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def verdict(met):
    return chat(json.dumps({"explanation": "because", "criteria_met": met}))


class JudgeServer:
    """A chat-completions endpoint whose `reply(index, body)` gives (status, payload, delay_s) per request."""

    def __init__(self, reply):
        self.reply, self.requests, self.in_flight, self.max_in_flight = reply, [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    index = len(server.requests)
                    server.requests.append((self.path, body, {k.lower(): v for k, v in self.headers.items()}))  # case-insensitive
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                status, payload, delay = server.reply(index, body)
                time.sleep(delay)
                with server.lock:
                    server.in_flight -= 1
                data = (json.dumps(payload) if not isinstance(payload, str) else payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client timed out and closed the connection
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(reply):
        servers.append(JudgeServer(reply))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def config(url, **kwargs):
    return JudgeConfig(base_url=url, model="grader-1", backoff_s=0.0, **kwargs)


def rubric_row():
    rubric, _ = rubric_and_gold(12)  # +3 parity, +2 digits, +2 factorisation, -4 "claims that 12 is prime"
    return PromptRow(row_id="t:0", messages=[{"role": "user", "content": "Describe the number 12."}],
                     data_source="healthbench", rubrics=rubric)


def met_if_parity_or_false_claim(index, body):
    prompt = body["messages"][0]["content"]
    return 200, verdict("[3] states" in prompt or "[-4] claims" in prompt), 0.0


def test_judge_grades_each_item_once_and_caches_identical_requests(serve):
    server = serve(met_if_parity_or_false_claim)
    reward = RubricReward(RubricConfig(grader="judge", judge=config(server.url, max_tokens=77)))
    result = reward("12 is even and prime.", rubric_row())
    assert result.info["criteria_met"] == [True, False, False, True]
    assert result.score == pytest.approx((3 - 4) / 7) and result.correct == 0.0
    assert len(server.requests) == 4  # one request per item
    path, body, _ = server.requests[0]
    assert path == "/v1/chat/completions"
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("grader-1", 0.0, 77)
    prompt = body["messages"][0]["content"]
    assert "user: Describe the number 12.\n\nassistant: 12 is even and prime." in prompt
    assert {b["messages"][0]["content"].split("# Rubric item\n")[1].split("\n")[0] for _, b, _ in server.requests} == {
        "[3] states that 12 is even", "[2] gives the number of digits (2)",
        "[2] gives the prime factorisation 2*2*3", "[-4] claims that 12 is prime"}
    assert (result.info["judge_calls"], result.info["judge_cache_hits"]) == (4.0, 0.0)
    again = reward("12 is even and prime.", rubric_row())
    assert len(server.requests) == 4 and again.score == result.score  # identical requests: from the cache
    assert (again.info["judge_calls"], again.info["judge_cache_hits"]) == (0.0, 4.0)
    reward("12 is odd.", rubric_row())
    assert len(server.requests) == 8  # a different response is a different request


def test_retries_server_errors_and_unparseable_replies(serve):
    replies = [(503, {"error": "busy"}, 0.0), (200, "not json", 0.0), (200, chat("no verdict"), 0.0),
               (200, verdict(True), 0.0)]
    server = serve(lambda index, body: replies[index] if index < len(replies) else (500, {"error": "down"}, 0.0))
    outcome = JudgeClient(config(server.url, max_retries=3)).complete(ASK, parse_verdict)
    assert (outcome.value, outcome.attempts, outcome.cached) == (True, 4, False)
    with pytest.raises(JudgeError, match="no usable reply after 2 attempts") as caught:
        JudgeClient(config(server.url, max_retries=1)).complete([{"role": "user", "content": "other"}], parse_verdict)
    assert not isinstance(caught.value, JudgeUnavailable)
    assert len(server.requests) == 4 + 2


def test_http_401_is_not_retried_and_the_key_never_leaks(serve, caplog):
    server = serve(lambda index, body: (401, {"error": "bad key"}, 0.0))
    client = JudgeClient(config(server.url, api_key_env="MY_JUDGE_KEY"), environ={"MY_JUDGE_KEY": "sk-secret-123"})
    expected = r"HTTP 401.*check the API key in \$MY_JUDGE_KEY"
    with caplog.at_level("DEBUG"), pytest.raises(JudgeError, match=expected) as err:
        client.complete(ASK, parse_verdict)
    assert len(server.requests) == 1
    assert server.requests[0][2]["authorization"] == "Bearer sk-secret-123"
    for text in (str(err.value), repr(client), caplog.text):
        assert "sk-secret" not in text


@pytest.mark.parametrize("status", [400, 500])
def test_a_server_echoing_the_key_does_not_leak_it(serve, caplog, status):
    echo = {"error": "bad request; headers: Authorization: Bearer sk-secret-123, other: Bearer tok-xyz"}
    server = serve(lambda index, body: (status, echo, 0.0))
    client = JudgeClient(config(server.url, api_key_env="MY_JUDGE_KEY", max_retries=1),
                         environ={"MY_JUDGE_KEY": "sk-secret-123"})
    with caplog.at_level("DEBUG"), pytest.raises(JudgeError) as err:
        client.complete(ASK, parse_verdict)
    assert "bad request" in str(err.value) + caplog.text  # the server's words are still shown
    for text in (str(err.value), caplog.text):
        assert "sk-secret" not in text and "tok-xyz" not in text


def test_no_key_no_authorization_header(serve):
    server = serve(lambda index, body: (200, verdict(False), 0.0))
    JudgeClient(config(server.url, api_key_env="ABSENT_KEY"), environ={}).complete(ASK, parse_verdict)
    assert "authorization" not in server.requests[0][2]


def test_a_down_endpoint_is_a_clear_error():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = JudgeClient(config(f"http://127.0.0.1:{port}/v1", max_retries=1))
    with pytest.raises(JudgeUnavailable, match=rf"judge endpoint http://127.0.0.1:{port}/v1/chat/completions "
                                               r"unreachable after 2 attempts.*reward.judge.base_url"):
        client.complete(ASK, parse_verdict)


def test_a_slow_endpoint_times_out(serve):
    server = serve(lambda index, body: (200, verdict(True), 2.0))
    client = JudgeClient(config(server.url, timeout_s=0.2, max_retries=1))
    with pytest.raises(JudgeUnavailable, match=r"unreachable after 2 attempts \(TimeoutError: timed out\)"):
        client.complete(ASK, parse_verdict)
    assert len(server.requests) == 2


@pytest.mark.parametrize("limit", [2, 6])
def test_concurrency_limit(serve, limit):
    server = serve(lambda index, body: (200, verdict(True), 0.4))
    client = JudgeClient(config(server.url, max_concurrency=limit))
    asks = [[{"role": "user", "content": f"item {i}"}] for i in range(6)]
    assert [o.value for o in client.map(lambda m: client.complete(m, parse_verdict), asks)] == [True] * 6
    assert server.max_in_flight <= limit
    if limit == 6:  # without a limit the six requests do overlap, so the check above can fail
        assert server.max_in_flight > 2


def test_config_checks_and_worst_case():
    with pytest.raises(ValueError, match="base_url must start with http"):
        JudgeConfig(base_url="judge:8000")
    # worst case of one call: 2 attempts of 3 s, plus one backoff of 1 s
    assert JudgeConfig(timeout_s=3.0, max_retries=1, backoff_s=1.0).worst_case_s() == 7.0


def test_builtin_rubric_judge_uses_the_run_configs_judge(serve):
    server = serve(met_if_parity_or_false_claim)
    cfg = load_config("base", [f"reward.judge.base_url={server.url}", "reward.judge.max_retries=0",
                               "+reward.sources.healthbench=rubric_judge", "reward.num_workers=1"])
    assert cfg.reward.judge == JudgeConfig(base_url=server.url, max_retries=0)
    with RewardManager(cfg.reward) as manager:
        result = manager.score(["12 is even."], [rubric_row()])[0]
    assert result.score == pytest.approx((3 - 4) / 7) and len(server.requests) == 4
    # a reward built with its own judge keeps it
    own = RubricReward(RubricConfig(grader="judge", judge=config("http://elsewhere:1/v1")))
    assert own.with_reward_config(cfg.reward) is own


def test_judge_in_a_reward_worker_and_its_failure_counted(serve, monkeypatch):
    server = serve(met_if_parity_or_false_claim)
    name = f"test_judge_{server.url.rsplit(':', 1)[1].split('/')[0]}"
    judge = RubricReward(RubricConfig(grader="judge", judge=config(server.url, max_retries=1)))
    monkeypatch.setitem(REWARDS._entries, name, judge)  # registered for this test only
    with RewardManager(RewardConfig(sources={"healthbench": name}, num_workers=1, timeout_s=30)) as manager:
        ok = manager.score(["12 is even."], [rubric_row()])[0]
        assert ok.score == pytest.approx((3 - 4) / 7) and len(server.requests) == 4  # requests came from the worker
        server.close()
        failed = manager.score(["12 is odd."], [rubric_row()])[0]
        assert manager.metrics()["reward/num_errors"] == 1.0
    assert failed.info["fallback"] == "error" and failed.info["error"].startswith("JudgeUnavailable: judge endpoint")
    metrics = judge_metrics([ok.info, failed.info])
    assert (metrics["judge/num_requests"], metrics["judge/num_failures"]) == (4.0, 1.0)
