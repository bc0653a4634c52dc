"""`aligner-ext serve` and the `remote` engine on the tiny model: the same tokens as the in-process
engine, `n` / stop / log-probs, weight pushes that change what the server samples, a server that dies,
API keys and request bounds, several servers behind one client."""

import copy
import time
from contextlib import contextmanager

import openai
import pytest
import torch

from aligner_ext.config import load_config
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.remote import RemoteEngine, RemoteEngineConfig, ServerError, parse_choice
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model
from served_engine import serve_in_thread, serving

pytestmark = pytest.mark.timeout(120)

TEXTS = ["hello there", "a", "what is 2+2?", "xyzxyzxyzxyz", "hello there", "Q: name a colour."]


def small_model(tokenizer):
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=3)
    return build_tiny_model(tokenizer, shape).eval()


def engine_on(model, tokenizer):
    return RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=8))


@contextmanager
def served(model, tokenizer, **settings):
    """(URL, server) of a server on a copy of `model` (its own weights, as a separate process has)."""
    served_model = copy.deepcopy(model)
    server = serving(engine_on(served_model, tokenizer), served_model, tokenizer, **settings)
    with serve_in_thread(server) as url:
        yield url, server


def remote(policy, tokenizer, urls, **settings):
    return RemoteEngine(policy, tokenizer, RemoteEngineConfig(urls=urls, **settings))


def stops_from(tokenizer, outputs):
    """A stop string and a stop token id that the greedy outputs are known to contain (ends some sequences early)."""
    text = tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)
    return [text[3:5]], [outputs[1].token_ids[4]]


def test_greedy_rollouts_through_two_servers_equal_the_in_process_engine(tiny_tokenizer):
    tok = tiny_tokenizer
    model = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS]
    local = engine_on(model, tok)
    plain = local.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    stop, stop_ids = stops_from(tok, plain)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=stop, stop_token_ids=stop_ids, return_logprobs=True)
    expected = local.generate(prompts, params)
    assert {output.finish_reason for output in expected} >= {"stop", "length"}  # the stops do end some sequences
    with served(model, tok) as (url_a, server_a), served(model, tok) as (url_b, server_b):
        got = remote(model, tok, [url_a, url_b], max_prompts_per_request=2, routing="round_robin").generate(prompts, params)
        assert server_a.counters.values["generation_tokens_total"] > 0  # both servers took chunks
        assert server_b.counters.values["generation_tokens_total"] > 0
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    for ours, theirs in zip(got, expected):
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


def test_n_and_seed_sample_the_in_process_engines_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    model = small_model(tok)
    prompt = tok.encode("what is 2+2?")
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7, return_logprobs=True)
    expected = engine_on(model, tok).generate([prompt] * 3, params)  # per-request streams: (seed, index)
    with served(model, tok) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        response = client.completions.create(model="aligner-ext", prompt=[prompt], n=3, max_tokens=10, temperature=1.0,
                                             top_p=0.9, seed=7, logprobs=1)
    got = [parse_choice(choice, url, True) for choice in sorted(response.choices, key=lambda c: c.index)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert len({tuple(o.token_ids) for o in got}) > 1  # the three samples differ
    assert response.usage.prompt_tokens == len(prompt)


def test_finish_reasons_map_back_from_openai_fields():
    class Choice:
        def __init__(self, finish_reason, stop_reason):
            self.finish_reason, self.logprobs = finish_reason, None
            self.model_extra = {"token_ids": [1, 2], "stop_reason": stop_reason}

    assert parse_choice(Choice("stop", None), "u", False).finish_reason == "eos"
    assert parse_choice(Choice("stop", "###"), "u", False).finish_reason == "stop"
    assert parse_choice(Choice("stop", 17), "u", False).finish_reason == "stop"
    assert parse_choice(Choice("length", None), "u", False).finish_reason == "length"
    # SGLang's choices carry `matched_stop` instead: the stop string, or the token id that matched, EOS's included
    sglang = Choice("stop", None)
    for matched, stop_token_ids, reason in (("###", (), "stop"), (17, (17,), "stop"), (2, (17,), "eos"), (None, (), "eos")):
        sglang.model_extra = {"token_ids": [1, 2], "matched_stop": matched}
        assert parse_choice(sglang, "u", False, stop_token_ids).finish_reason == reason
    sglang.finish_reason = "abort"  # an aborted request (partial rollouts): cut short where it stood
    assert parse_choice(sglang, "u", False).finish_reason == "length"
    missing = Choice("stop", None)
    missing.model_extra = {}
    with pytest.raises(ServerError, match="no token ids"):
        parse_choice(missing, "http://x", False)


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_weights_pushed_after_an_update_change_the_servers_outputs(tiny_tokenizer, tmp_path, weight_sync):
    tok = tiny_tokenizer
    policy = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS[:4]]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    with (served(policy, tok, weights_root=str(tmp_path)) as (url_a, _),
          served(policy, tok, weights_root=str(tmp_path)) as (url_b, server_b)):
        engine = remote(policy, tok, [url_a, url_b], weight_sync=weight_sync, weight_sync_dir=str(tmp_path / "sync"),
                        weight_sync_address="127.0.0.1", max_prompts_per_request=2)
        before = engine.generate(prompts, greedy)
        with torch.no_grad():  # an "optimizer step" that changes every weight
            for param in policy.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        updated = engine_on(policy, tok).generate(prompts, greedy)
        assert [o.token_ids for o in updated] != [o.token_ids for o in before]
        assert [o.token_ids for o in engine.generate(prompts, greedy)] == [o.token_ids for o in before]  # not pushed yet
        engine.weights_version = 3  # the policy version the push carries
        engine.update_weights(policy)
        after = engine.generate(prompts, greedy)
        assert server_b.weight_version == 3 and all(o.versions == [3] * len(o.token_ids) for o in after)
        engine.weights_version = 4
        engine.update_weights(policy)  # a second push reuses the weight group / directory
        assert server_b.weight_version == 4
        served_params = dict(server_b.model.named_parameters())
        assert all(torch.equal(served_params[name], param) for name, param in policy.named_parameters())
    assert [o.token_ids for o in after] == [o.token_ids for o in updated]


def test_a_server_that_dies_gives_retries_then_an_error_naming_it(tiny_tokenizer):
    tok = tiny_tokenizer
    model = small_model(tok)
    prompts = [tok.encode("hello")]
    with served(model, tok) as (url, _):
        engine = remote(model, tok, [url], max_retries=2, timeout_s=5)
        assert len(engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))) == 1
    started = time.monotonic()
    with pytest.raises(ServerError, match=f"{url} failed \\(retried up to 2 times.*APIConnectionError"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert time.monotonic() - started < 60


def test_api_key_bounds_and_health(tiny_tokenizer):
    tok = tiny_tokenizer
    model = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS[:3]]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    with served(model, tok, api_key="secret", max_prompts_per_request=2, max_tokens=8) as (url, _):
        with pytest.raises(ServerError, match="AuthenticationError"):
            remote(model, tok, [url], model="aligner-ext").generate(prompts[:1], greedy)
        keyed = remote(model, tok, [url], api_key="secret", max_retries=0)
        assert len(keyed.generate(prompts[:2], greedy)) == 2
        with pytest.raises(ServerError, match="max_prompts_per_request=2"):
            remote(model, tok, [url], api_key="secret", max_prompts_per_request=3, max_retries=0).generate(prompts, greedy)
        with pytest.raises(ServerError, match="max_tokens=8"):
            keyed.generate(prompts[:1], SamplingParams(max_new_tokens=9, temperature=0.0))
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert client.get("/health", cast_to=object)["status"] == "ok"  # no key needed
        keyed_client = openai.OpenAI(base_url=url, api_key="secret", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="not served"):
            keyed_client.post("/v1/completions", body={"prompt": [1, 2], "logprobs": 5}, cast_to=object)


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="urls"):
        RemoteEngine(None, None, RemoteEngineConfig())
    with pytest.raises(ValueError, match="weight_sync_dir"):
        RemoteEngine(None, None, RemoteEngineConfig(urls=["http://x"], weight_sync="disk"))
    with pytest.raises(ValueError, match="^generator.remote.weight_sync='nfs': must be one of none, disk, distributed$"):
        load_config("base", ["generator.remote.weight_sync=nfs"])


@pytest.mark.slow
def test_aligner_ext_serve_killed_mid_request_gives_retries_then_an_error(tiny_tokenizer, tmp_path):
    """The real `aligner-ext serve` process on a saved checkpoint, killed while a request is in flight."""
    import signal
    import subprocess
    import sys
    import threading

    from aligner_ext.distributed import free_port

    tok = tiny_tokenizer
    small_model(tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "aligner_ext", "serve", f"model.path={tmp_path / 'model'}",
                                "generator.engine=hf", f"serve.port={port}", f"trainer.output_dir={tmp_path}"])
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.get("/health", cast_to=object)["status"] == "ok"
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and process.poll() is None, "aligner-ext serve did not start"
                time.sleep(0.2)
        engine = remote(small_model(tok), tok, [url], max_retries=2, timeout_s=10)
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
        prompts = [tok.encode(text) for text in TEXTS]
        expected = engine_on(small_model(tok), tok).generate(prompts, greedy)
        assert [o.token_ids for o in engine.generate(prompts, greedy)] == [o.token_ids for o in expected]
        long = SamplingParams(max_new_tokens=4000, temperature=1.0, ignore_eos=True)
        threading.Timer(1.0, process.send_signal, args=(signal.SIGKILL,)).start()  # while generating
        started = time.monotonic()
        with pytest.raises(ServerError, match=f"{url} failed \\(retried up to 2 times"):
            engine.generate([prompts[0]] * 64, long)
        assert time.monotonic() - started < 60
    finally:
        process.kill()
        process.wait()


def two_rank_worker(rank: int, directory: str, urls: list[str]) -> None:
    """One trainer rank of two (gloo): generate through the servers, split across ranks, then push weights."""
    import torch.distributed as dist

    from aligner_ext.generation.sharded import split_across_ranks
    from aligner_ext.models.tiny import build_char_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    tok = build_char_tokenizer()
    policy = small_model(tok)
    engine = split_across_ranks(remote(policy, tok, urls, weight_sync="distributed", weight_sync_address="127.0.0.1",
                                       max_prompts_per_request=2), enabled=True)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [tok.encode(text) for text in TEXTS]
    before = engine.generate(prompts, greedy)
    torch.manual_seed(5)  # the same "update" on both ranks
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    engine.weights_version = 1  # the push carries it, and every rank then checks it in the servers' answers
    engine.update_weights(policy)  # rank 0 pushes over its own group; rank 1 waits at the barrier
    after = engine.generate(prompts, greedy)
    torch.save({"before": [o.token_ids for o in before], "after": [o.token_ids for o in after]},
               f"{directory}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_trainer_ranks_share_the_servers_and_rank_0_pushes_the_weights(tiny_tokenizer, tmp_path):
    import torch.multiprocessing as mp

    tok = tiny_tokenizer
    model = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    with served(model, tok) as (url_a, server_a), served(model, tok) as (url_b, server_b):
        mp.spawn(two_rank_worker, args=(str(tmp_path), [url_a, url_b]), nprocs=2, join=True)
    updated = small_model(tok)
    torch.manual_seed(5)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    expected_before = [o.token_ids for o in engine_on(model, tok).generate(prompts, greedy)]
    expected_after = [o.token_ids for o in engine_on(updated, tok).generate(prompts, greedy)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got == {"before": expected_before, "after": expected_after}  # every rank has every output
    assert server_a.weight_version == server_b.weight_version == 1  # one push, from rank 0 only, of version 1
