"""Weight pushes carry the policy version (generation/remote.py, serving/server.py): the server reports the
version it samples under, the remote engine stamps every token with it and refuses, in one error naming the
server and both versions, tokens sampled under weights it did not push last; a server that reports no
version is stamped with the pushed one, said once."""

import logging

import openai
import pytest

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.remote import ServerError
from aligner_ext.serving.server import GenerationServer
from test_server_and_remote import remote, served, small_model

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
