"""What one client may hold of `aligner-ext serve`: a body bounded however it is sent, a request whose
client left stops and frees the engine, a bound on the tokens one request makes the engine generate."""

import http.client
import json
import socket
import time
from urllib.parse import urlparse

import openai
import pytest

from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model
from served_engine import serve_in_thread, serving

pytestmark = pytest.mark.timeout(120)

LONG = 16000  # tokens: minutes of decoding on CPU, if nothing stops it


def long_model(tokenizer):
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            max_position_embeddings=LONG + 64, seed=3)
    return build_tiny_model(tokenizer, shape).eval()


def test_a_chunked_body_past_the_limit_gets_413(tiny_tokenizer):
    model = long_model(tiny_tokenizer)
    server = serving(RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig()), model, tiny_tokenizer,
                     max_body_bytes=1000)
    body = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    with serve_in_thread(server) as url:
        address = urlparse(url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        connection.request("POST", "/v1/completions", body=(body[i : i + 500] for i in range(0, len(body), 500)),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413
        assert "serve.max_body_bytes=1000" in json.loads(response.read())["error"]["message"]
        connection.close()
        # a body under the limit, chunked as well, is served
        small = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        connection.request("POST", "/v1/completions", body=iter([small[:5], small[5:]]),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        assert connection.getresponse().status == 200
        connection.close()
    assert server.counters.values["request_errors_total"] == 1


def leave_mid_request(url: str, payload: dict) -> None:
    """Send a completions request, then disconnect while the engine works on it."""
    address = urlparse(url)
    body = json.dumps(payload).encode()
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.0)  # the engine has started the call


@pytest.mark.parametrize("engine_name", ["rollout", "hf"])
def test_a_client_that_disconnects_frees_the_engine_for_the_next_request(tiny_tokenizer, engine_name):
    tok = tiny_tokenizer
    model = long_model(tok)
    engine = (RolloutEngine(model, tok, RolloutEngineConfig()) if engine_name == "rollout"
              else HFGenerationEngine(model, tok, HFEngineConfig()))
    server = serving(engine, model, tok, request_timeout_s=20)
    with serve_in_thread(server) as url:
        leave_mid_request(url, {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True, "n": 4})
        started = time.monotonic()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        response = client.completions.create(model="aligner-ext", prompt="hi", max_tokens=3, temperature=0.0)
        waited = time.monotonic() - started
    assert len(response.choices[0].token_ids) <= 3
    assert waited < 5, f"the next request waited {waited:.1f} s for an engine nobody was reading"
    assert server.counters.values["generation_tokens_total"] <= 3  # the abandoned request was not counted as served


def test_a_request_asking_more_tokens_than_one_request_may_hold_gets_400(tiny_tokenizer):
    model = long_model(tiny_tokenizer)
    server = serving(RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig()), model, tiny_tokenizer,
                     max_tokens_per_request=100)
    with serve_in_thread(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError, match=r"prompts x n x max_tokens=120 exceeds "
                                                         r"serve.max_tokens_per_request=100"):
            client.completions.create(model="aligner-ext", prompt=["ab", "cd"], n=3, max_tokens=20)
        assert len(client.completions.create(model="aligner-ext", prompt=["ab", "cd"], n=3, max_tokens=16).choices) == 6
