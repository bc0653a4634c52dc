"""Weight pushes carry the policy version (generation/remote.py, serving/server.py): the server reports the
version it samples under, the remote engine stamps every token with it and refuses, in one error naming the
server and both versions, tokens sampled under weights it did not push last; a server that reports no
version is stamped with the pushed one, said once; a call stopped at a push (partial rollouts) is aborted on
the server and resumes under the pushed weights."""

import copy
import itertools
import logging
from dataclasses import replace

import openai
import pytest
import torch

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.remote import ServerError
from aligner_ext.generation.resumable import ResumableEngine
from aligner_ext.serving.server import GenerationServer
from served_engine import serve_in_thread, serving
from test_remote_vllm import perturbed
from test_server_and_remote import TEXTS, remote, served, small_model

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def pushing(policy, tokenizer, url, tmp_path, name):
    """A remote engine that pushes its weights through the disk to the server at `url`."""
    return remote(policy, tokenizer, [url], weight_sync="disk", weight_sync_dir=str(tmp_path / name), max_retries=0)


def test_tokens_carry_the_pushed_version_and_another_push_is_one_clear_error(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    policy = small_model(tok)
    prompts = [tok.encode("hello"), tok.encode("a")]
    with served(policy, tok, weights_root=str(tmp_path)) as (url, server):
        trainer = pushing(policy, tok, url, tmp_path, "ours")
        trainer.weights_version = 2
        trainer.update_weights(policy)
        outputs = trainer.generate(prompts, GREEDY)
        assert [o.versions for o in outputs] == [[2] * len(o.token_ids) for o in outputs]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert client.get("/health", cast_to=object)["weight_version"] == 2
        answer = client.post("/v1/completions", body={"prompt": prompts[0], "max_tokens": 2}, cast_to=object)
        assert answer["metadata"] == {"weight_version": "2"}  # SGLang's field, a string as there
        other = pushing(policy, tok, url, tmp_path, "theirs")  # another trainer pushing to the same server
        other.weights_version = 5
        other.update_weights(policy)
        with pytest.raises(ServerError, match=f"^generation server {url} sampled under weight version 5, but this "
                                              "trainer pushed version 2 last: check that no other trainer"):
            trainer.generate(prompts, GREEDY)
        client.post("/update_weights_from_disk", body={"model_path": str(tmp_path / "ours")}, cast_to=object)
        assert server.weight_version == 6  # an update without a version counts on from the server's


def test_a_server_that_reports_no_version_is_stamped_with_the_pushed_one_said_once(tiny_tokenizer, tmp_path,
                                                                                   monkeypatch, caplog):
    generate = GenerationServer.generate

    def without_version(server, *args):  # as vLLM answers
        answer = generate(server, *args)
        del answer["metadata"]
        return answer

    monkeypatch.setattr(GenerationServer, "generate", without_version)
    tok = tiny_tokenizer
    policy = small_model(tok)
    with served(policy, tok, weights_root=str(tmp_path)) as (url, _):
        trainer = pushing(policy, tok, url, tmp_path, "ours")
        trainer.weights_version = 7
        trainer.update_weights(policy)
        with caplog.at_level(logging.WARNING, logger="aligner_ext.generation.remote"):
            first = trainer.generate([tok.encode("hello")], GREEDY)
            second = trainer.generate([tok.encode("a")], GREEDY)
    assert first[0].versions == [7] * len(first[0].token_ids) and second[0].versions == [7] * len(second[0].token_ids)
    said = [record.getMessage() for record in caplog.records if "reports no weight version" in record.getMessage()]
    assert said == [f"generation server {url} reports no weight version (vLLM, SGLang before its weight_version): "
                    "its tokens are stamped with the version pushed last, 7"]


def test_a_call_stopped_at_a_push_is_aborted_on_the_server_and_resumes_under_the_pushed_weights(tiny_tokenizer,
                                                                                                 tmp_path, monkeypatch):
    """Partial rollouts through a server: the server's engine (hf, polled after each decode step) is held at
    its third poll until the abort arrives, so the park falls after three tokens without timing; the
    resumption is a new request, re-prefilled under the pushed weights."""
    polls = itertools.count(1)

    def held_at_the_third_step(server, cancelled, aborted):
        if next(polls) == 3:
            assert aborted.wait(timeout=60)  # only a server that does not abort waits this long
        return cancelled.is_set() or aborted.is_set()

    monkeypatch.setattr(GenerationServer, "stop_wanted", held_at_the_third_step)
    tok = tiny_tokenizer
    policy, new = small_model(tok), perturbed(small_model(tok))
    prompts = [tok.encode(text) for text in TEXTS[:3]]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = [o.token_ids[:3] for o in HFGenerationEngine(policy, tok, HFEngineConfig()).generate(prompts, greedy)]
    after = [o.token_ids for o in HFGenerationEngine(new, tok, HFEngineConfig()).generate(
        [prompt + start for prompt, start in zip(prompts, before)], replace(greedy, max_new_tokens=5))]
    served_model = copy.deepcopy(policy)
    server = serving(HFGenerationEngine(served_model, tok, HFEngineConfig()), served_model, tok,
                     weights_root=str(tmp_path))
    with serve_in_thread(server) as url:
        engine = ResumableEngine(pushing(policy, tok, url, tmp_path, "ours"), tok)
        engine.update_weights(policy)  # version 0

        def push_the_update():  # the trainer's refit, once the call has parked
            with torch.no_grad():
                for mine, theirs in zip(policy.parameters(), new.parameters()):
                    mine.copy_(theirs)
            engine.weights_version = 1
            engine.update_weights(policy)

        engine.refit_wanted = lambda: engine.weights_version == 0 and bool(server.aborts)  # once it is in flight
        engine.await_refit = push_the_update
        outputs = engine.generate(prompts, greedy)
    assert [o.token_ids for o in outputs] == [start + rest for start, rest in zip(before, after)]
    assert all(o.versions == [0] * 3 + [1] * 5 and o.finish_reason == "length" for o in outputs)
    assert server.weight_version == 1
