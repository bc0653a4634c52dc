"""`aligner-ext serve` under abuse, on 127.0.0.1 with the tiny model: prompt + max_tokens against the
model's positions, a megabyte prompt refused before it is tokenised, weight updates only from weight
directories under serve.weights_root, OpenAI's 404 for an unknown model, the key compared in constant
time, no open server on another address unless asked, and a concurrent load of good and bad requests
that get their status codes and leave the server answering as before."""

import hmac
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import torch
from served_engine import serve_in_thread, serving

from aligner_ext.cli import main
from aligner_ext.config import ServeConfig
from aligner_ext.errors import ConfigError
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model
from aligner_ext.weights_file import save_weights

pytestmark = pytest.mark.timeout(120)

POSITIONS = 512
KEY = "secret-key"
MEGABYTE = 1_000_000


def tiny(tokenizer, seed=0, hidden_size=32):
    shape = TinyModelConfig(hidden_size=hidden_size, num_layers=2, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_position_embeddings=POSITIONS, seed=seed)
    return build_tiny_model(tokenizer, shape).eval()


class CountingEngine(RolloutEngine):
    """The rollout engine, counting the prompts it is asked to generate from."""

    prompts_seen = 0

    def generate(self, prompts, params, should_stop=None):
        self.prompts_seen += len(prompts)
        return super().generate(prompts, params, should_stop=should_stop)


def make_server(tokenizer, **settings):
    model = tiny(tokenizer)
    return serving(CountingEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=8)), model, tokenizer, **settings)


def call(url, method, path, body=None, key=KEY, headers=None, timeout=60):
    """(status, parsed JSON or text) of one request; `body` a dict (sent as JSON), bytes or None."""
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout)
    sent = {"Content-Type": "application/json"}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    sent.update(headers or {})
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        connection.putrequest(method, path)
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(payload or b"")))
        connection.endheaders(payload)
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def message(answer) -> str:
    return answer[1]["error"]["message"]


def test_prompt_and_max_tokens_are_checked_against_the_models_positions(tiny_tokenizer):
    server = make_server(tiny_tokenizer)
    with serve_in_thread(server) as url:
        refused = call(url, "POST", "/v1/completions", {"prompt": [5] * 600, "max_tokens": 16})
        assert refused[0] == 400
        assert message(refused) == "prompt of 600 tokens + max_tokens=16 = 616 exceeds the model's 512 positions"
        assert "513" in message(call(url, "POST", "/v1/completions", {"prompt": [5] * 501, "max_tokens": 12}))
        # text and chat prompts are counted in tokens too
        assert call(url, "POST", "/v1/completions", {"prompt": "a" * 600})[0] == 400
        chat = call(url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 600}]})
        assert chat[0] == 400 and "exceeds the model's 512 positions" in message(chat)
        assert server.engine.prompts_seen == 0  # nothing reached the engine
        # exactly the model's positions is served, to the last token
        status, body = call(url, "POST", "/v1/completions", {"prompt": [5] * 500, "max_tokens": 12, "ignore_eos": True})
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 12


def test_a_megabyte_prompt_is_refused_before_it_is_tokenised(tiny_tokenizer, monkeypatch):
    tokenised = []
    encode, render = tiny_tokenizer.encode, tiny_tokenizer.apply_chat_template
    monkeypatch.setattr(tiny_tokenizer, "encode", lambda text, *a, **k: tokenised.append(len(text)) or encode(text, *a, **k))
    monkeypatch.setattr(tiny_tokenizer, "apply_chat_template",
                        lambda messages, *a, **k: tokenised.append(-1) or render(messages, *a, **k))
    server = make_server(tiny_tokenizer)
    huge = "x" * MEGABYTE
    with serve_in_thread(server) as url:
        for path, body, size in (
            ("/v1/completions", {"prompt": huge}, MEGABYTE),
            ("/v1/completions", {"prompt": ["hi", huge]}, MEGABYTE),  # each prompt on its own
            # a chat request's strings together ("user" too): they make one prompt
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": huge}]}]}, MEGABYTE + 4),
        ):
            started = time.monotonic()
            refused = call(url, "POST", path, body)
            assert time.monotonic() - started < 5
            assert refused[0] == 400
            # unset serve.max_prompt_chars: 32 characters per position
            assert message(refused).startswith(f"prompt of {size} characters exceeds {32 * POSITIONS} ")
        assert tokenised == [] and server.engine.prompts_seen == 0
    capped = make_server(tiny_tokenizer, max_prompt_chars=100)
    with serve_in_thread(capped) as url:
        assert message(call(url, "POST", "/v1/completions", {"prompt": "y" * 101})) == \
            "prompt of 101 characters exceeds serve.max_prompt_chars=100"
        assert call(url, "POST", "/v1/completions", {"prompt": "y" * 100, "max_tokens": 2})[0] == 200
    assert tokenised == [100]


def test_weights_load_only_from_weight_directories_under_the_root(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    root, outside = tmp_path / "root", tmp_path / "outside"
    for directory in (root / "step_1", root / "empty", root / "garbage", root / "other", root / "linked_file", outside):
        directory.mkdir(parents=True)
    update = tiny(tok, seed=1)
    save_weights(update, root / "step_1" / "model.safetensors")
    save_weights(update, outside / "model.safetensors")
    save_weights(tiny(tok, hidden_size=16), root / "other" / "model.safetensors")
    (root / "garbage" / "model.safetensors").write_bytes(b"\x00" * 64)
    (root / "linked").symlink_to(outside)
    (root / "linked_file" / "model.safetensors").symlink_to(outside / "model.safetensors")

    def load(path):
        return call(url, "POST", "/update_weights_from_disk", {"model_path": str(path)})

    with serve_in_thread(make_server(tok)) as url:  # no serve.weights_root: refused
        refused = load(root / "step_1")
        assert refused[0] == 403 and "serve.weights_root" in message(refused)
    server = make_server(tok, weights_root=str(root))
    before = {name: value.clone() for name, value in server.model.state_dict().items()}
    with serve_in_thread(server) as url:
        for path, status, says in (
            ("/etc/passwd", 403, "outside serve.weights_root"),
            (root / "step_1" / ".." / ".." / "outside", 403, "outside serve.weights_root"),
            (root / "linked", 403, "outside serve.weights_root"),  # a symlink to a directory outside
            (root / "linked_file", 403, "outside serve.weights_root"),  # its model.safetensors links outside
            (root / "step_1" / "model.safetensors", 400, "is not a directory"),
            (root / "missing", 400, "is not a directory"),
            (root / "empty", 400, "holds no model.safetensors"),
            (root / "garbage", 400, "is not a readable safetensors file"),
            (root / "other", 400, "do not match the served model"),
            ("bad\x00path", 400, "is not a usable path"),
        ):
            answer = load(path)
            assert answer[0] == status and says in message(answer), (path, answer)
        assert server.weight_version == 0
        assert all(torch.equal(before[name], value) for name, value in server.model.state_dict().items())
        assert load(root / "step_1")[0] == 200
    assert server.weight_version == 1
    assert all(torch.equal(update.state_dict()[name], value) for name, value in server.model.state_dict().items())
    with pytest.raises(ConfigError, match=f"serve.weights_root={tmp_path / 'nowhere'}: no such directory"):
        make_server(tok, weights_root=str(tmp_path / "nowhere"))


def test_an_unknown_model_gets_openais_404(tiny_tokenizer):
    with serve_in_thread(make_server(tiny_tokenizer)) as url:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
            status, answer = call(url, "POST", path, {**body, "model": "gpt-4"})
            assert status == 404
            assert answer["error"]["code"] == "model_not_found" and answer["error"]["param"] == "model"
            assert answer["error"]["type"] == "invalid_request_error" and "`gpt-4` does not exist" in answer["error"]["message"]
            assert call(url, "POST", path, {**body, "model": "aligner-ext"})[0] == 200
            assert call(url, "POST", path, body)[0] == 200  # no model named: the served one
        assert call(url, "GET", "/v1/models")[1]["data"][0]["id"] == "aligner-ext"


def test_the_key_is_compared_in_constant_time(tiny_tokenizer, monkeypatch):
    compared = []

    def compare_digest(given, expected):
        compared.append((given, expected))
        return original(given, expected)

    original = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    body = {"prompt": "hi", "max_tokens": 2}
    with serve_in_thread(make_server(tiny_tokenizer, api_key=KEY)) as url:
        assert call(url, "POST", "/v1/completions", body, key=None)[0] == 401
        assert call(url, "POST", "/v1/completions", body, key=KEY[:-1])[0] == 401
        assert call(url, "POST", "/v1/completions", body, key=KEY + "x")[0] == 401
        # a header that is not ASCII: refused, not a server error
        assert call(url, "POST", "/v1/completions", body, key=None,
                    headers={"Authorization": "Bearer sécret".encode().decode("latin-1")})[0] == 401
        assert call(url, "POST", "/v1/completions", body)[0] == 200
        assert call(url, "GET", "/health", key=None)[0] == 200
    assert compared[-1] == (f"Bearer {KEY}".encode(), f"Bearer {KEY}".encode())
    assert (f"Bearer {KEY[:-1]}".encode(), f"Bearer {KEY}".encode()) in compared


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gen1.cluster"])
def test_an_address_other_than_loopback_needs_a_key_or_an_explicit_open_server(host, monkeypatch):
    with pytest.raises(ValueError, match=f"^serve.host={host} is reachable from other machines and serve.api_key is unset"):
        ServeConfig(host=host)
    assert ServeConfig(host=host, allow_unauthenticated=True).api_key is None
    monkeypatch.setenv("SERVE_KEY", KEY)
    assert ServeConfig(host=host, api_key_env="SERVE_KEY").api_key == KEY


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.7", "localhost", "::1"])
def test_loopback_serves_without_a_key(host):
    assert ServeConfig(host=host).api_key is None


def test_aligner_ext_serve_refuses_to_start_open_on_all_interfaces_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "serve.host=0.0.0.0"])  # refused when the config loads, before any model
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "serve.host=0.0.0.0 is reachable from other machines" in err and "serve.allow_unauthenticated=true" in err
    for setting, says in (("serve.port=70000", "serve.port=70000: must be a finite number >= 0 and <= 65535"),
                          ("serve.max_prompt_chars=0", "serve.max_prompt_chars=0: must be a finite number >= 1")):
        with pytest.raises(SystemExit):
            main(["config", setting])
        assert says in capsys.readouterr().err


def test_a_concurrent_load_of_good_and_bad_requests(tiny_tokenizer, tmp_path):
    """32 at once, each kind several times: every one gets its status, and the server answers as before."""
    good = {"prompt": "hello there", "max_tokens": 4, "temperature": 0.0}
    cases = [
        ("POST", "/v1/completions", good, KEY, 200),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, KEY, 200),
        ("GET", "/health", None, None, 200),
        ("GET", "/v1/models", None, KEY, 200),
        ("POST", "/v1/completions", b"{not json", KEY, 400),
        ("POST", "/v1/completions", b"[1, 2, 3]", KEY, 400),
        ("POST", "/v1/completions", b"", KEY, 400),
        ("POST", "/v1/completions", b"[" * 50_000, KEY, 400),
        ("POST", "/v1/completions", {"max_tokens": 4}, KEY, 400),  # no prompt
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": "hi", "n": 10_000}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": [[]]}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": [10**30]}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": "\ud800"}, KEY, 400),  # a lone surrogate
        ("POST", "/v1/completions", {"prompt": "hi", "seed": 2**70}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": "hi", "stop_token_ids": [10**20]}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": [7] * 600, "max_tokens": 16}, KEY, 400),
        ("POST", "/v1/completions", {"prompt": "z" * MEGABYTE}, KEY, 400),
        ("POST", "/v1/chat/completions", {"messages": [{"role": 1}]}, KEY, 400),
        ("POST", "/v1/completions", b"x" * (3 * 2**20), KEY, 413),
        ("POST", "/v1/completions", good, None, 401),
        ("POST", "/v1/completions", {**good, "model": "someone-else"}, KEY, 404),
        ("POST", "/update_weights_from_disk", {"model_path": "/etc/passwd"}, KEY, 403),
        ("POST", "/update_weights_from_disk", {"model_path": str(tmp_path)}, KEY, 400),  # no weights there
        ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 99999, "rank_offset": 1,
                                                "world_size": 2}, KEY, 400),
        ("POST", "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, KEY, 400),
        ("GET", "/no/such/route", None, KEY, 404),
        ("GET", "/v1/completions", None, KEY, 405),
    ]
    load = cases * 8  # 224 requests
    server = make_server(tiny_tokenizer, api_key=KEY, weights_root=str(tmp_path), max_body_bytes=2 * 2**20)
    with serve_in_thread(server) as url:
        expected = call(url, "POST", "/v1/completions", good)[1]["choices"][0]["token_ids"]
        started = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            got = list(pool.map(lambda case: call(url, case[0], case[1], case[2], key=case[3]), load))
        took = time.monotonic() - started
        for (method, path, body, _, status), (answer, payload) in zip(load, got):
            shown = body[:40] if isinstance(body, bytes) else json.dumps(body)[:80]
            assert answer == status, (method, path, shown, payload)
            if status >= 400:
                assert isinstance(payload, dict) and set(payload["error"]) == {"message", "type", "param", "code"}
        assert call(url, "GET", "/health", key=None)[0] == 200
        after = call(url, "POST", "/v1/completions", good)
        assert after[0] == 200 and after[1]["choices"][0]["token_ids"] == expected
    assert took < 60
    errors = sum(status >= 400 for *_, status in load)
    assert server.counters.values["request_errors_total"] == errors
    assert server.counters.values["requests_total"] == len(load) + 3
    assert server.weight_version == 0
