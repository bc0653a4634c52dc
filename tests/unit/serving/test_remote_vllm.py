"""generator.remote.server_kind=vllm against a fake vLLM server built from vLLM's source
(tests/fake_vllm_server.py): the routes called, in order, with vLLM's payloads; pushes from disk and over
the weight group that change what the servers hold and sample; clear errors for a server without the
routes. The fake's weight group is gloo, so the trainer's NCCL end (vLLM's PyNcclCommunicator) is
replaced by generation/weight_group.py here: that end is not tested."""

import copy
import json
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from aligner_ext.config import load_config
from aligner_ext.generation import remote_vllm
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.remote import RemoteEngine, RemoteEngineConfig, ServerError
from aligner_ext.generation.weight_group import WeightGroup
from fake_vllm_server import FakeVllm, build_fake_vllm_app
from served_engine import serve_in_thread, serving
from test_server_and_remote import TEXTS, engine_on, remote, served, small_model

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@contextmanager
def fake_vllm(model, tokenizer, **settings):
    """(URL, FakeVllm) of a fake vLLM server on a copy of `model`."""
    served_model = copy.deepcopy(model)
    fake = FakeVllm(serving(engine_on(served_model, tokenizer), served_model, tokenizer), **settings)
    with serve_in_thread(fake.server, build_fake_vllm_app(fake)) as url:
        yield url, fake


def weight_calls(fake):
    """(method, path, query, JSON body) of the calls other than generation's."""
    return [(method, path, query, json.loads(body) if body else None)
            for method, path, query, body in fake.calls if not path.startswith("/v1/")]


def perturbed(model):
    """An "optimizer step" that changes every weight of `model` in place."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    return model


def assert_holds(fake, policy):
    served = fake.server.model.state_dict()
    assert all(torch.equal(served[name], param) for name, param in policy.named_parameters())


@pytest.fixture
def gloo_rank0(monkeypatch):
    """The trainer's end of the weight group over gloo, as the fake's workers join it (a refused update
    leaves it waiting for receivers: it gives up after 20 s, where the test fails)."""
    monkeypatch.setattr(remote_vllm, "check_policy_device", lambda device: None)  # the CPU stands in for the GPU
    monkeypatch.setattr(remote_vllm, "nccl_rank0", lambda device: lambda address, port, world: WeightGroup(
        address, port, 0, world, "gloo", timeout_s=20))


def test_a_push_from_disk_reloads_every_vllm_server(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    policy = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS[:4]]
    sync = tmp_path / "sync"
    with fake_vllm(policy, tok) as (url_a, fake_a), fake_vllm(policy, tok) as (url_b, fake_b):
        engine = remote(policy, tok, [url_a, url_b], server_kind="vllm", weight_sync="disk", weight_sync_dir=str(sync),
                        max_prompts_per_request=2)
        before = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        updated = [o.token_ids for o in engine_on(perturbed(policy), tok).generate(prompts, GREEDY)]
        assert updated != before
        engine.update_weights(policy)
        after = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        for fake in (fake_a, fake_b):
            assert weight_calls(fake) == [
                ("POST", "/pause", {}, {}),
                ("POST", "/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": str(sync)}}),
                ("POST", "/resume", {}, {}),
            ]
            assert_holds(fake, policy)
            assert not fake.paused
    assert after == updated
    assert sorted(path.name for path in sync.iterdir()) == ["model.safetensors"]  # what vLLM's loader globs
    written = load_file(sync / "model.safetensors")
    assert written.keys() == policy.state_dict().keys()  # lm_head.weight too, the tied head (remote_vllm.py)
    assert all(torch.equal(written[name], value) for name, value in policy.state_dict().items())


def test_an_in_memory_push_reaches_every_worker_of_every_vllm_server(tiny_tokenizer, gloo_rank0):
    tok = tiny_tokenizer
    policy = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS[:4]]
    # the tied output layer under its own name too: vLLM reloads every layer apart (remote_vllm.py)
    names = [name for name, _ in policy.named_parameters()] + ["lm_head.weight"]
    shapes = [list(param.shape) for param in policy.parameters()] + [list(policy.lm_head.weight.shape)]
    with fake_vllm(policy, tok, workers=1) as (url_a, fake_a), fake_vllm(policy, tok, workers=2) as (url_b, fake_b):
        engine = remote(policy, tok, [url_a, url_b], server_kind="vllm", weight_sync="distributed",
                        weight_sync_address="127.0.0.1", weight_sync_port=0, max_prompts_per_request=2)
        updated = [o.token_ids for o in engine_on(perturbed(policy), tok).generate(prompts, GREEDY)]
        engine.update_weights(policy)
        after = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        perturbed(policy)
        engine.update_weights(policy)  # a second push reuses the group
        assert_holds(fake_a, policy)
        assert_holds(fake_b, policy)
        assert fake_a.received == [names * 2] and fake_b.received == [names * 2, names * 2]
        calls_a, calls_b = weight_calls(fake_a), weight_calls(fake_b)
    assert after == updated
    # the trainer is rank 0, server a's one worker rank 1, server b's two workers ranks 2 and 3
    port = calls_a[1][3]["init_info"]["master_port"]
    assert port > 0 and calls_b[1][3]["init_info"]["master_port"] == port
    push = [("POST", "/pause", {}, {}),
            ("POST", "/start_weight_update", {}, {"is_checkpoint_format": True}),
            ("POST", "/update_weights", {}, {"update_info": {
                "names": names, "dtype_names": ["float32"] * len(names),
                "shapes": shapes}}),
            ("POST", "/finish_weight_update", {}, {}),
            ("POST", "/resume", {}, {})]
    for calls, offset in ((calls_a, 1), (calls_b, 2)):
        assert calls == [("GET", "/get_world_size", {}, None),
                         ("POST", "/init_weight_transfer_engine", {}, {"init_info": {
                             "master_address": "127.0.0.1", "master_port": port, "rank_offset": offset,
                             "world_size": 4}}),
                         *push, *push]


def test_a_server_without_vllms_routes_gets_an_error_naming_it_and_the_setting(tiny_tokenizer, tmp_path, gloo_rank0):
    tok = tiny_tokenizer
    policy = small_model(tok)
    with fake_vllm(policy, tok, dev_mode=False) as (url, _):  # vLLM started without VLLM_SERVER_DEV_MODE=1
        engine = remote(policy, tok, [url], server_kind="vllm", weight_sync="disk", weight_sync_dir=str(tmp_path))
        with pytest.raises(ServerError, match=f"{url} has no /pause endpoint .*server_kind=vllm.*VLLM_SERVER_DEV_MODE=1"):
            engine.update_weights(policy)
    with served(policy, tok) as (url, _):  # ours speaks SGLang's endpoints
        engine = remote(policy, tok, [url], server_kind="vllm", weight_sync="distributed", weight_sync_address="127.0.0.1")
        with pytest.raises(ServerError, match=f"{url} has no /get_world_size endpoint .*set generator.remote.server_kind=sglang"):
            engine.update_weights(policy)
    with fake_vllm(policy, tok) as (url, _):  # a vLLM server driven as SGLang
        engine = remote(policy, tok, [url], weight_sync="disk", weight_sync_dir=str(tmp_path))
        with pytest.raises(ServerError, match=f"{url} has no /update_weights_from_disk endpoint .*server_kind=vllm"):
            engine.update_weights(policy)


def test_the_fake_refuses_what_vllm_refuses(tiny_tokenizer):
    """The fake is as strict as vLLM's routes, so the payloads that pass above are ones vLLM accepts."""
    import openai

    tok = tiny_tokenizer
    with fake_vllm(small_model(tok), tok) as (url, fake):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        update = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
        with pytest.raises(openai.InternalServerError, match="start_weight_update must be called before"):
            client.post("/update_weights", body=update, cast_to=object)
        with pytest.raises(openai.InternalServerError, match="unexpected \\['dtypes'\\]"):  # SGLang's field name
            client.post("/update_weights", body={"update_info": {"names": [], "dtypes": [], "shapes": []}}, cast_to=object)
        with pytest.raises(openai.InternalServerError, match="unexpected \\['backend'\\]"):
            client.post("/init_weight_transfer_engine", body={"init_info": {
                "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}},
                cast_to=object)
        with pytest.raises(openai.BadRequestError, match="Missing 'init_info'"):
            client.post("/init_weight_transfer_engine", body={"master_address": "127.0.0.1"}, cast_to=object)
        client.post("/start_weight_update", body={}, cast_to=object)
        with pytest.raises(openai.InternalServerError, match="already active"):
            client.post("/start_weight_update", body={}, cast_to=object)
        client.post("/finish_weight_update", body={}, cast_to=object)
        client.post("/pause", body={}, cast_to=object)
        with pytest.raises(openai.APIStatusError) as paused:
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).completions.create(
                model="aligner-ext", prompt=[[1, 2]], max_tokens=2)
        assert paused.value.status_code == 503
        assert not fake.update_active


def test_settings_vllm_cannot_take_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="^generator.remote.server_kind='trtllm': must be one of sglang, vllm$"):
        load_config("base", ["generator.remote.server_kind=trtllm"])
    with pytest.raises(ValueError, match="NCCL only"):
        RemoteEngineConfig(server_kind="vllm", weight_sync="distributed", weight_sync_backend="gloo")
    with pytest.raises(ValueError, match="needs the policy on a GPU .it is on cpu.: .* use generator.remote.weight_sync=disk$"):
        RemoteEngine(small_model(tiny_tokenizer), tiny_tokenizer, RemoteEngineConfig(
            urls=["http://127.0.0.1:1"], server_kind="vllm", weight_sync="distributed"))
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs vLLM installed beside the trainer"):
            remote_vllm.nccl_rank0(torch.device("cuda"))


def test_a_seeded_sampling_call_asks_vllm_once_per_group_with_n_and_each_samples_seed(tiny_tokenizer):
    """vLLM seeds every prompt of a request alike and child j of a prompt asked with `n` from seed + j: one
    request per run of identical prompts, seeded for its first sample k with seed * 0x100000001B3 + k,
    gives sample k that seed whatever the chunking (here chunks of 6 cut the second group in two)."""
    tok = tiny_tokenizer
    policy = small_model(tok)
    prompts = [tok.encode(text) for text in TEXTS[:3]]
    calls = [prompt for prompt in prompts for _ in range(4)]
    base = 5 * 1099511628211
    with fake_vllm(policy, tok) as (url, fake):
        engine = remote(policy, tok, [url], server_kind="vllm", max_prompts_per_request=6)
        outputs = engine.generate(calls, SamplingParams(max_new_tokens=3, temperature=1.0, seed=5))
        engine.generate(calls, GREEDY)
    requests = [json.loads(body) for _, path, _, body in fake.calls if path == "/v1/completions"]
    sampled = sorted(((request["prompt"], request["n"], request["seed"]) for request in requests[:4]), key=lambda r: r[2])
    assert sampled == [([prompts[0]], 4, base), ([prompts[1]], 2, base + 4), ([prompts[1]], 2, base + 6),
                       ([prompts[2]], 4, base + 8)]
    assert len(outputs) == 12
    greedy = sorted((request["prompt"], request["n"]) for request in requests[4:])  # seeds do not matter: a chunk
    assert greedy == sorted([(calls[:6], 1), (calls[6:], 1)])
