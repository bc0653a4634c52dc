"""The hint_logprobs wrapper on the tiny model: hinted log-probs equal an unpadded single-sequence forward,
entropy, difficulty, metrics, skipped rows, the switch, and no compounding over optimisation iterations."""

import dataclasses

import pytest
import torch

from aligner_ext.algorithms.advantages import GroupAdvantage
from aligner_ext.algorithms.cpo import CPOAdvantage
from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import load_config
from aligner_ext.context import BuildContext
from aligner_ext.data.hints import HintConfig
from aligner_ext.data.templating import encode_prompt, left_pad, right_pad
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import ExperienceMaker
from aligner_ext.experience.hint_logprobs import HintLogprobs
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import HFPolicy
from aligner_ext.models.settings import PolicyConfig

GOLD_A, GOLD_B = "12+7=19\n\\boxed{19}", "3+4=7\n7+5=12\n\\boxed{12}"
ROW_A = PromptRow("t:0", [{"role": "user", "content": "12+7="}], "arithmetic", "19",
                  extra_info={"gold_solution": GOLD_A})
ROW_B = PromptRow("t:1", [{"role": "user", "content": "3+4+5="}], "arithmetic", "12",
                  extra_info={"gold_solution": GOLD_B})
RESPONSES = ["19<|im_end|>", "12+7=19", "11", "3+4=7\n7+5=12"]
REWARDS = [1.0, 1.0, 0.0, 1.0]


class FixedMaker(ExperienceMaker):
    """Returns the same scored batch: rows A, A, B, B."""

    def __init__(self, tokenizer, rows):
        self.tokenizer, self.rows = tokenizer, rows

    def make_experience(self, loader, step):
        rows = [row for row in self.rows for _ in range(2)]
        prompt_ids, prompt_mask = left_pad([encode_prompt(self.tokenizer, r.messages) for r in rows], 0)
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in RESPONSES]
        response_ids, valid = right_pad(ids, 0)
        return ExperienceBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                               response_valid=valid, response_mask=valid.clone(), group_ids=torch.tensor([4, 4, 9, 9]),
                               samples=[SampleInfo(row=r) for r in rows], rewards=torch.tensor(REWARDS),
                               correct=torch.tensor(REWARDS)), {"reward/x": 1.0}


@pytest.fixture
def policy(tiny_model):
    return HFPolicy(tiny_model, PolicyConfig(device="cpu", dtype="float64", micro_batch_size=3), total_steps=1)


def single_forward(model, tokenizer, prompt_text, response_text):
    """(log-probs, entropy) of the response tokens from one unpadded sequence with default positions."""
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    chosen = logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)
    return chosen, -(logp.exp() * logp).sum(dim=1)


def chatml(user):
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def wrapper(policy, tokenizer, rows=(ROW_A, ROW_B), hint=None):
    return HintLogprobs(FixedMaker(tokenizer, list(rows)), hint or HintConfig(), True, policy, tokenizer,
                        temperature=1.0)


def test_hint_logprobs_equal_an_unpadded_forward_of_the_hinted_prompt(policy, tiny_tokenizer):
    batch, metrics = wrapper(policy, tiny_tokenizer).make_experience(None, 0)
    batch.old_logprobs, batch.entropy = policy.logprobs(batch, 1.0)  # the loop's pass, after the maker
    estimator = CPOAdvantage.from_context(context(policy, tiny_tokenizer, "+variant=cpo"))
    estimator(batch)
    mi_metrics = estimator.metrics()
    mis, gains = [], {True: [], False: []}
    for i, (row, gold) in enumerate([(ROW_A, GOLD_A), (ROW_A, GOLD_A), (ROW_B, GOLD_B), (ROW_B, GOLD_B)]):
        question = row.messages[0]["content"]
        length = int(batch.response_valid[i].sum())
        hint_lp, _ = single_forward(policy.model, tiny_tokenizer, chatml(f"{gold}\n{question}"), RESPONSES[i])
        plain_lp, entropy = single_forward(policy.model, tiny_tokenizer, chatml(question), RESPONSES[i])
        torch.testing.assert_close(batch.hint_logprobs[i, :length].double(), hint_lp, rtol=0, atol=1e-6)
        torch.testing.assert_close(batch.entropy[i, :length].double(), entropy, rtol=0, atol=1e-6)
        assert not torch.allclose(hint_lp, plain_lp)  # the hint does change the scores
        assert (batch.hint_logprobs[i, length:] == 0).all()
        mis.append(hint_lp.exp() * (hint_lp - plain_lp))
        gains[REWARDS[i] == 1.0].append(hint_lp - plain_lp)
    mi = torch.cat(mis)
    # the hint's gain per token, on the correct rows (0, 1, 3) and on the wrong one (2) apart
    assert mi_metrics["cpo/hint_gain_correct"] == pytest.approx(float(torch.cat(gains[True]).mean()), abs=1e-6)
    assert mi_metrics["cpo/hint_gain_wrong"] == pytest.approx(float(torch.cat(gains[False]).mean()), abs=1e-6)
    assert mi_metrics["cpo/mi_mean"] == pytest.approx(float(mi.mean()), abs=1e-6)
    assert mi_metrics["cpo/mi_std"] == pytest.approx(float(mi.std(unbiased=False)), abs=1e-6)
    assert mi_metrics["cpo/mi_positive_fraction"] == pytest.approx(float((mi > 0).double().mean()))
    assert metrics["cpo/hint_rows"] == 4 and metrics["cpo/hint_missing"] == 0
    assert metrics["cpo/hint_tokens_mean"] == pytest.approx((len(GOLD_A) + len(GOLD_B)) / 2 + 1)
    assert metrics["reward/x"] == 1.0  # the inner maker's metrics are kept
    assert batch.has_hint.tolist() == [True] * 4
    # the estimator's difficulty: group 4 (rewards 1, 1) all correct, group 9 (0, 1) mixed
    assert mi_metrics["cpo/difficulty_all_correct"] == 0.5 and mi_metrics["cpo/difficulty_mixed"] == 0.5


def test_rows_without_a_hint_are_skipped_and_counted(policy, tiny_tokenizer):
    bare = dataclasses.replace(ROW_B, extra_info={})
    maker = wrapper(policy, tiny_tokenizer, rows=(ROW_A, bare), hint=HintConfig(missing="skip"))
    batch, metrics = maker.make_experience(None, 0)
    assert batch.has_hint.tolist() == [True, True, False, False]
    assert (batch.hint_logprobs[2:] == 0).all() and (batch.hint_logprobs[:2] != 0).any()
    assert metrics["cpo/hint_missing"] == 2 and metrics["cpo/hint_rows"] == 2


def context(policy, tokenizer, *overrides, reads=CPOAdvantage.reads):
    """What build gives a plug-in; `reads`: the fields the advantage and loss read."""
    return BuildContext(cfg=load_config("base", list(overrides)), tokenizer=tokenizer, policy=policy,
                        engine=None, rewards=None, reads_after_experience=frozenset(reads),
                        vocab_size=policy.model.config.vocab_size)


def test_the_wrapper_turns_itself_on_only_when_a_later_stage_reads_hints(policy, tiny_tokenizer):
    inner = FixedMaker(tiny_tokenizer, [ROW_A])
    assert HintLogprobs.from_context(inner, context(policy, tiny_tokenizer, reads=GroupAdvantage.reads)) is inner
    built = HintLogprobs.from_context(inner, context(policy, tiny_tokenizer, "+variant=cpo",
                                                     "cpo.hint.placement=assistant_turn"))
    assert isinstance(built, HintLogprobs) and built.inner is inner
    assert built.hint.placement == "assistant_turn" and built.gold_as_hint


def test_several_optimisation_iterations_do_not_compound_the_shaping(policy, tiny_tokenizer):
    ctx = context(policy, tiny_tokenizer, "+variant=cpo", "cpo.pos_alpha=0.2")
    batch, _ = HintLogprobs.from_context(FixedMaker(tiny_tokenizer, [ROW_A, ROW_B]), ctx).make_experience(None, 0)
    batch.old_logprobs, batch.entropy = policy.logprobs(batch, 1.0)
    estimator = CPOAdvantage.from_context(ctx)
    batch.advantages = estimator(batch)
    shaped = batch.advantages.clone()
    assert estimator.metrics()["cpo/advantage_change_abs_mean"] > 0
    policy.cfg.num_iterations = 3
    policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 1.0)
    assert torch.equal(batch.advantages, shaped)  # the loss read them three times and changed nothing
    assert torch.equal(estimator(batch), shaped)  # recomputed from the stored quantities: the same
