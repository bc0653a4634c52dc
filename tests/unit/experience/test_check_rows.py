"""`ExperienceMaker.check_rows`, which the build runs over the training rows before the first step: a
wrapper checks its inner maker's rows too; the CPO hint pass refuses a row without a hint, the graded
system prompt a chat template that cannot render a system message."""

import pytest

from aligner_ext.data.hints import HintConfig
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import ConfigError, DataError
from aligner_ext.experience.base import GroupSampling, RolloutConfig
from aligner_ext.experience.dynamic_sampling import DynamicSampling, DynamicSamplingConfig
from aligner_ext.experience.graded_prompt import GradedPromptConfig, GradedPromptSampling
from aligner_ext.experience.hint_logprobs import HintLogprobs
from aligner_ext.models.tiny import build_char_tokenizer

NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{{ m['content'] }}{% endfor %}")
RUBRIC = [{"criterion": "states that 4 is even", "points": 1.0}]


def row(index, **fields):
    return PromptRow(row_id=f"train.jsonl:{index}", messages=[{"role": "user", "content": "2+2?"}],
                     data_source="arithmetic", ground_truth="4", **fields)


def graded(tokenizer, enabled=True):
    return GradedPromptSampling(RolloutConfig(n=2), GradedPromptConfig(enabled=enabled), None, None, tokenizer)


def test_the_hint_pass_checks_every_row_through_the_wrappers_inside_it():
    tokenizer = build_char_tokenizer()
    inner = DynamicSampling(GroupSampling(RolloutConfig(n=2), None, None, tokenizer), DynamicSamplingConfig(), 0)
    maker = HintLogprobs(inner, HintConfig(), True, None, tokenizer, 1.0)
    rows = [row(0, extra_info={"gold_solution": "4"}), row(1)]
    with pytest.raises(DataError, match=r"^row train\.jsonl:1: no extra_info\.gold_solution"):
        maker.check_rows(rows)
    HintLogprobs(inner, HintConfig(missing="skip"), True, None, tokenizer, 1.0).check_rows(rows)


def test_the_graded_prompt_refuses_a_template_without_a_system_role_when_on():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = NO_SYSTEM
    rows = [row(0), row(1, rubrics=RUBRIC)]
    wrapped = DynamicSampling(graded(tokenizer), DynamicSamplingConfig(), 0)
    with pytest.raises(ConfigError, match=r"^row train\.jsonl:1: the tokenizer's chat template cannot render a "
                                          r"system message .*graded_prompt\.enabled"):
        wrapped.check_rows(rows)
    graded(tokenizer, enabled=False).check_rows(rows)  # off: the plain prompts are sampled
    graded(build_char_tokenizer()).check_rows(rows)  # ChatML renders a system message
