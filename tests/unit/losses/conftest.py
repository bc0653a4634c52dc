"""A factory for ExperienceBatch objects carrying only what a loss reads."""

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptRow


@pytest.fixture
def make_batch():
    def make(response_mask, advantages, old_logprobs, ref_logprobs=None, group_ids=None):
        mask = torch.as_tensor(response_mask, dtype=torch.bool)
        rows, width = mask.shape
        return ExperienceBatch(
            prompt_ids=torch.ones(rows, 1, dtype=torch.long),
            prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
            response_ids=torch.ones(rows, width, dtype=torch.long),
            response_valid=mask.clone(),
            response_mask=mask,
            group_ids=torch.arange(rows) if group_ids is None else torch.as_tensor(group_ids),
            samples=[SampleInfo(row=PromptRow(row_id=f"test:{i}", messages=[], data_source="test"))
                     for i in range(rows)],
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
        )

    return make
