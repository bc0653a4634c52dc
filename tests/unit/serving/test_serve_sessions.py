"""Agent sessions on `aligner-ext serve` (/sessions/<session>/v1/chat/completions) with the rollout engine:
an openai-SDK conversation of two turns is one row, its second turn continued on the kept cache (it
prefilled only its new ids), the session's rows readable and deletable over HTTP."""

import json
from contextlib import contextmanager
import urllib.error
import urllib.request

import openai
import torch
import pytest

from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model
from served_engine import serve_in_thread, serving

pytestmark = pytest.mark.timeout(120)


def ask(url: str, method: str = "GET") -> tuple[int, dict]:
    """(status, JSON body) of a request without a body."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@contextmanager
def served_tiny(tokenizer):
    """(URL, server, model): a tiny model served with the rollout engine (which keeps sessions' caches)."""
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=3)
    model = build_tiny_model(tokenizer, shape).eval()
    server = serving(RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=4)), model, tokenizer)
    with serve_in_thread(server) as url:
        yield url, server, model


def two_turns(url: str, session: str, between=lambda: None):
    """A conversation of two turns through the openai client; `between` runs after the first."""
    client = openai.OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "1+2="}]
    first = client.chat.completions.create(model="aligner-ext", messages=messages, max_tokens=6, seed=5)
    between()
    messages += [first.choices[0].message, {"role": "user", "content": "again"}]
    return first, client.chat.completions.create(model="aligner-ext", messages=messages, max_tokens=6)


def test_a_session_continues_on_its_kept_cache_and_its_row_is_what_was_sampled(tiny_tokenizer):
    with served_tiny(tiny_tokenizer) as (url, server, _):
        first, second = two_turns(url, "game-1")
        prompt1, sampled1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
        prompt2, sampled2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
        stats = dict(server.sessions.turns.stats)
        _, recorded = ask(f"{url}/sessions/game-1")
        deleted, _ = ask(f"{url}/sessions/game-1", "DELETE")
        gone, body = ask(f"{url}/sessions/game-1")
    assert prompt2[: len(prompt1) + len(sampled1)] == prompt1 + sampled1  # the first turn as sampled
    (row,) = recorded["rows"]
    assert row["ids"] == prompt2 + sampled2 and recorded["counts"]["turns"] == 2
    assert [role for role in row["roles"] if role == "sampled"] == ["sampled"] * (len(sampled1) + len(sampled2))
    # the slot kept the first turn's ids and its sampled ids but the last: the second turn prefilled the rest
    assert stats["reused_tokens"] == len(prompt1) + len(sampled1) - 1
    assert stats["prefilled_tokens"] == len(prompt1) + len(prompt2) - stats["reused_tokens"]
    assert deleted == 200 and gone == 404 and body["error"]["code"] == 404


def test_after_a_weight_push_a_session_goes_on_from_its_ids_on_a_fresh_cache(tiny_tokenizer):
    with served_tiny(tiny_tokenizer) as (url, server, model):
        def push():  # what a push does: other weights, then the engine told
            with torch.no_grad():
                next(model.parameters()).add_(0.01)
            server.weights_changed()

        _, second = two_turns(url, "s", push)
        fresh = dict(server.sessions.turns.stats)
        _, recorded = ask(f"{url}/sessions/s")
    prompt2, sampled2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    assert recorded["rows"][0]["ids"] == prompt2 + sampled2  # still one row: the conversation extends it
    # the old weights' K/V were dropped with the old turn session: the whole conversation is prefilled again
    assert fresh["prefilled_tokens"] == len(prompt2) and fresh["reused_tokens"] == 0 and fresh["turns"] == 1
