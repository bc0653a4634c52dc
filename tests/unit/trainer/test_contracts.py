"""Batch contracts (trainer/contracts.py): a stage that reads a field no earlier stage writes fails when the
components are built, naming the field, the plug-in that reads it and the plug-ins that write it."""

import pytest

from aligner_ext.algorithms.advantages import GroupAdvantage
from aligner_ext.algorithms.cpo import CPOAdvantage
from aligner_ext.algorithms.mtpo import MTPOAdvantage
from aligner_ext.errors import ContractError
from aligner_ext.experience.base import GroupSampling, RolloutConfig
from aligner_ext.experience.dynamic_sampling import DynamicSampling, DynamicSamplingConfig
from aligner_ext.experience.hint_logprobs import HintLogprobs
from aligner_ext.experience.two_round import TwoRoundSampling
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.trainer.contracts import BASE_FIELDS, Stage, check_stages, step_stages

GRPO = GroupAdvantage(GroupAdvantage.Config())
LOSS = ClippedPGLoss(ClippedPGLoss.Config())


def group_sampling():
    return GroupSampling(RolloutConfig(n=4), engine=None, rewards=None, tokenizer=None)


def two_round():
    return TwoRoundSampling(TwoRoundSampling.Config(num_answer_generations=2, num_confidence_generations=2),
                            RolloutConfig(n=4), engine=None, rewards=None, tokenizer=None)


def segment_filter(inner):
    return DynamicSampling(inner, DynamicSamplingConfig(filter_metric="segments", max_gen_batches=0), pad_token_id=0)


def test_the_base_fields_are_those_every_batch_is_built_with():
    assert BASE_FIELDS == {"prompt_ids", "prompt_mask", "response_ids", "response_valid", "response_mask",
                           "group_ids", "samples"}


def test_a_field_read_before_it_is_written_names_reader_and_writer():
    stages = [Stage("maker", (), ("rewards",)), Stage("advantage", ("rewards",), ("advantages",)),
              Stage("loss", ("advantages", "old_logprobs"), ())]
    with pytest.raises(ContractError, match="loss reads batch field 'old_logprobs', which no earlier stage"):
        check_stages(stages)
    check_stages(stages[:2])  # what is written earlier, or is a base field, may be read
    with pytest.raises(ContractError, match="advantage reads batch field 'rewards'"):
        check_stages([stages[1], stages[0]])  # written only later: too late
    with pytest.raises(ContractError, match="declares that it reads 'reward', which is not an ExperienceBatch field"):
        check_stages([Stage("maker", ("reward",), ())])


def test_mtpo_advantages_without_the_two_round_maker():
    stages = step_stages(group_sampling(), False, MTPOAdvantage(GroupAdvantage.Config()), "mtpo_segments", LOSS,
                         "clipped_pg")
    with pytest.raises(ContractError, match="advantage estimator mtpo_segments reads batch field 'answer_rewards', "
                                            r".* it is written by experience maker two_round \(algorithm.experience_maker\)$"):
        check_stages(stages)
    check_stages(step_stages(two_round(), False, MTPOAdvantage(GroupAdvantage.Config()), "mtpo_segments", LOSS,
                             "clipped_pg"))


def test_cpo_advantages_without_the_hint_pass_name_the_wrapper():
    class Estimator:  # the CPO estimator's contract, without its model-sized construction
        reads = CPOAdvantage.reads

    with pytest.raises(ContractError, match="advantage estimator cpo reads batch field 'hint_logprobs', .* written by "
                                            "experience wrapper hint_logprobs"):
        check_stages(step_stages(group_sampling(), False, Estimator(), "cpo", LOSS, "clipped_pg"))
    hinted = HintLogprobs(group_sampling(), hint=None, gold_as_hint=True, policy=None, tokenizer=None, temperature=1.0)
    stages = step_stages(hinted, False, Estimator(), "cpo", LOSS, "clipped_pg")
    assert [stage.name for stage in stages] == [
        "experience maker group_sampling", "experience wrapper hint_logprobs", "the policy's old-log-prob pass",
        "advantage estimator cpo", "loss clipped_pg"]
    check_stages(stages)


def test_the_segment_filter_needs_the_two_round_maker_inside_it():
    with pytest.raises(ContractError, match="experience wrapper dynamic_sampling reads batch field 'answer_group_ids'"):
        check_stages(step_stages(segment_filter(group_sampling()), False, GRPO, "grpo", LOSS, "clipped_pg"))
    check_stages(step_stages(segment_filter(two_round()), False, MTPOAdvantage(GroupAdvantage.Config()),
                             "mtpo_segments", LOSS, "clipped_pg"))


def test_a_kl_term_needs_the_reference_stage():
    kl_loss = ClippedPGLoss(ClippedPGLoss.Config(kl_coef=0.1))
    with pytest.raises(ContractError, match="loss clipped_pg reads batch field 'ref_logprobs'"):
        check_stages(step_stages(group_sampling(), False, GRPO, "grpo", kl_loss, "clipped_pg"))
    check_stages(step_stages(group_sampling(), True, GRPO, "grpo", kl_loss, "clipped_pg"))
