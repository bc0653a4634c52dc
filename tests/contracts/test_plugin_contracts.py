"""Contracts of the registries beside the batch stages, over every registered name: KL estimators,
built-in tasks, reward functions, generation engines and policy backends. A new plug-in is covered when it registers.
(Losses: test_loss_contracts.py; advantages: test_advantage_contracts.py; makers and wrappers:
test_experience_contracts.py; CPO wrappers: tests/unit/algorithms/test_cpo_wrappers.py runs every name
against a float64 reference.)"""

import copy
import pickle

import pytest
import torch

from aligner_ext.models.settings import PolicyConfig
import aligner_ext.plugins  # noqa: F401 - registers the built-in plug-ins
from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import GeneratorConfig
from aligner_ext.data.tasks import TASKS, sft_target
from aligner_ext.data.types import PromptRow
from aligner_ext.generation.base import ENGINES, SamplingParams
from aligner_ext.generation.remote import RemoteEngineConfig
from aligner_ext.losses.kl import KL_ESTIMATORS
from aligner_ext.models.base import POLICIES
from aligner_ext.rewards.base import REWARDS, as_result
from served_engine import serve_in_thread, serving


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_contract(name):
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]], dtype=torch.float64)
    ref = torch.tensor([[-0.7, -1.0, -1.0], [-0.1, -2.0, -0.2]], dtype=torch.float64)
    kl = KL_ESTIMATORS.get(name)(logprobs, ref)
    assert kl.shape == logprobs.shape and torch.isfinite(kl).all()
    assert (KL_ESTIMATORS.get(name)(logprobs, logprobs) == 0).all()  # no divergence from itself
    assert (kl[logprobs != ref] != 0).all()


@pytest.mark.parametrize("name", TASKS.names())
def test_task_contract(name):
    train = TASKS.get(name)("train", 12, 3)
    val = TASKS.get(name)("val", 6, 3)
    assert len(train) == 12 and len(val) == 6 and all(isinstance(row, PromptRow) for row in train + val)
    assert [row.row_id for row in train] == [row.row_id for row in TASKS.get(name)("train", 12, 3)]  # seeded
    ids = [row.row_id for row in train + val]
    assert len(set(ids)) == len(ids)
    assert all(row.messages and row.messages[-1]["role"] == "user" for row in train + val)


def reward_row(name: str) -> PromptRow:
    """A row holding what reward `name` compares with: a number, a short answer, a letter or a rubric."""
    task = {"squad_exact_match": "short_qa", "rubric": "rubric_qa", "rubric_clipped": "rubric_qa"}.get(name, "arithmetic")
    if name == "multiple_choice":
        return PromptRow("c:mc", [{"role": "user", "content": "1 + 1? A) 1 B) 2"}], "multiple_choice", "B",
                         extra_info={"gold_solution": "1 + 1 = 2, so B."})
    return TASKS.get(task)("train", 1, 0)[0]


@pytest.mark.parametrize("name", REWARDS.names())
def test_reward_contract(name):
    if name.startswith("rubric_judge"):
        pytest.skip("asks an LLM judge over HTTP: tests/unit/rewards/test_rubric_judge_client.py serves a fake one")
    fn, row = REWARDS.get(name), reward_row(name)
    results = [as_result(fn(response, row)) for response in ("", sft_target(row))]  # finite float32 scores
    assert all(result.correct in (None, 0.0, 1.0) for result in results)
    copied = pickle.loads(pickle.dumps(fn))  # the reward manager's worker processes get a pickled copy
    assert as_result(copied(sft_target(row), row)) == results[1]


@pytest.mark.parametrize("name", ENGINES.names())
def test_engine_contract(name, tiny_model, tiny_tokenizer):
    if name == "vllm":
        pytest.skip("vLLM does not install here: tests/unit/generation/test_vllm_colocated.py checks it against a fake")
    if name == "remote":  # the client of a server that runs the HF engine on the same model
        server = serving(ENGINES.get("hf")(tiny_model, tiny_tokenizer, GeneratorConfig().hf), tiny_model, tiny_tokenizer)
        with serve_in_thread(server) as url:
            engine_contract(ENGINES.get(name)(tiny_model, tiny_tokenizer, RemoteEngineConfig(urls=[url])), tiny_tokenizer)
    else:
        engine_contract(ENGINES.get(name)(tiny_model, tiny_tokenizer, getattr(GeneratorConfig(), name)), tiny_tokenizer)


def engine_contract(engine, tiny_tokenizer):
    prompts = [tiny_tokenizer("12+7=", add_special_tokens=False)["input_ids"],
               tiny_tokenizer("3+4+5=", add_special_tokens=False)["input_ids"]] * 2
    params = SamplingParams(max_new_tokens=5, temperature=1.0, return_logprobs=True, seed=7)
    outputs = engine.generate(prompts, params)
    assert len(outputs) == len(prompts)
    for output in outputs:
        assert 1 <= len(output.token_ids) <= 5 and output.finish_reason in ("eos", "stop", "length")
        assert output.finish_reason != "length" or len(output.token_ids) == 5
        assert len(output.logprobs) == len(output.token_ids) and all(lp <= 0 for lp in output.logprobs)
    again = engine.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # a seeded call repeats


def tiny_batch(tokenizer) -> ExperienceBatch:
    ids = torch.tensor([tokenizer("12+7=19", add_special_tokens=False)["input_ids"]] * 2)
    valid = torch.tensor([[True] * ids.shape[1], [True] * (ids.shape[1] - 2) + [False] * 2])
    return ExperienceBatch(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        response_ids=ids, response_valid=valid, response_mask=valid.clone(), group_ids=torch.tensor([0, 0]),
        samples=[SampleInfo(row=PromptRow(row_id=f"c:{i}", messages=[], data_source="c")) for i in range(2)])


@pytest.mark.parametrize("name", POLICIES.names())
def test_policy_contract(name, tiny_model, tiny_tokenizer):
    if name == "megatron":
        pytest.skip("needs a torch.distributed process group: tests/megatron/ runs it under torchrun")
    policy = POLICIES.get(name)(tiny_model, PolicyConfig(device="cpu"), total_steps=4)
    batch = tiny_batch(tiny_tokenizer)
    logprobs, entropy = policy.logprobs(batch, 1.0)
    assert logprobs.shape == entropy.shape == batch.response_ids.shape
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert (logprobs[batch.response_valid] < 0).all() and (entropy[batch.response_valid] > 0).all()
    state = policy.state_dict()
    restored = POLICIES.get(name)(copy.deepcopy(tiny_model), PolicyConfig(device="cpu"), total_steps=4)
    restored.load_state_dict(copy.deepcopy(state))
    assert repr(restored.state_dict()) == repr(state)
