"""The server's and the remote engine's API keys read from where the user names them (aligner_ext/secrets.py):
a server keyed from a file accepts a client keyed from an environment variable, and refuses one without it."""

import copy

import pytest

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.remote import RemoteEngine, RemoteEngineConfig, ServerError
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from served_engine import serve_in_thread, serving

pytestmark = pytest.mark.timeout(120)


def test_a_key_file_on_the_server_and_a_key_variable_on_the_client(tiny_tokenizer, tiny_model, tmp_path, monkeypatch):
    key_file = tmp_path / "serve.key"
    key_file.write_text("key-from-a-file\n")
    monkeypatch.setenv("GEN_KEY", "key-from-a-file")
    served_model = copy.deepcopy(tiny_model)
    engine = RolloutEngine(served_model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=4))
    prompts = [tiny_tokenizer.encode("hello there")]
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    with serve_in_thread(serving(engine, served_model, tiny_tokenizer, api_key_file=str(key_file))) as url:
        keyed = RemoteEngine(tiny_model, tiny_tokenizer, RemoteEngineConfig(urls=[url], api_key_env="GEN_KEY"))
        assert len(keyed.generate(prompts, greedy)) == 1
        unkeyed = RemoteEngine(tiny_model, tiny_tokenizer, RemoteEngineConfig(urls=[url], model="m", max_retries=0))
        with pytest.raises(ServerError, match="AuthenticationError"):
            unkeyed.generate(prompts, greedy)
