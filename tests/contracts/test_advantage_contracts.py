"""Every registered advantage estimator on a batch holding only the base fields and the fields it declares
it reads (trainer/contracts.py): the declaration is enough, and the result is [B, R] float32, finite,
0 outside the response mask and not 0 everywhere inside it. A new estimator is covered when it registers."""

from types import SimpleNamespace

import pytest
import torch

import aligner_ext.plugins  # noqa: F401 - registers the built-in plug-ins
from aligner_ext.algorithms.advantages import ADVANTAGES
from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import load_config
from aligner_ext.context import BuildContext
from aligner_ext.data.types import PromptRow
from aligner_ext.trainer.contracts import BASE_FIELDS

ROWS, WIDTH = 8, 4


def batch_with_everything() -> ExperienceBatch:
    """2 prompts x 2 answers x 2 continuations (MTPO's layout, which single-round estimators read as
    2 groups of 4); ragged responses, one generated token left out of the loss on row 1."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4, 3, 4, 2, 4, 1, 3, 4])
    valid = torch.arange(WIDTH)[None, :] < lengths[:, None]
    mask = valid.clone()
    mask[1, 0] = False
    answer_rewards = torch.tensor([1.5, 1.5, 0.5, 0.5, 0.0, 0.0, 1.5, 1.5])
    confidence_rewards = torch.tensor([1.0, 0.5, 1.5, 1.5, 0.0, 0.0, 1.0, 1.25])
    return ExperienceBatch(
        prompt_ids=torch.ones(ROWS, 2, dtype=torch.long), prompt_mask=torch.ones(ROWS, 2, dtype=torch.bool),
        response_ids=torch.ones(ROWS, WIDTH, dtype=torch.long), response_valid=valid, response_mask=mask,
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        samples=[SampleInfo(row=PromptRow(row_id=f"c:{i}", messages=[], data_source="c")) for i in range(ROWS)],
        rewards=answer_rewards + confidence_rewards, correct=(answer_rewards > 1).float(),
        token_rewards=torch.zeros(ROWS, WIDTH),
        old_logprobs=-torch.rand(ROWS, WIDTH, generator=gen), entropy=torch.rand(ROWS, WIDTH, generator=gen),
        hint_logprobs=-torch.rand(ROWS, WIDTH, generator=gen), has_hint=torch.ones(ROWS, dtype=torch.bool),
        answer_group_ids=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
        segment_ids=(torch.arange(WIDTH)[None, :] >= 2).long().expand(ROWS, WIDTH).clone(),
        answer_rewards=answer_rewards, confidence_rewards=confidence_rewards,
    )


def only(batch: ExperienceBatch, fields) -> ExperienceBatch:
    """`batch` with every optional field outside `fields` cleared."""
    for name in set(ExperienceBatch.__dataclass_fields__) - BASE_FIELDS - set(fields):
        setattr(batch, name, None)
    return batch


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_estimator_contract(name, tiny_model):
    overrides = ["rollout.n=4"] + (["+variant=cpo", "cpo.wrap_method=mi3"] if name == "cpo" else [])
    ctx = BuildContext(cfg=load_config("base", overrides), tokenizer=None, policy=SimpleNamespace(model=None),
                       engine=None, rewards=None, vocab_size=tiny_model.config.vocab_size)
    estimator = ADVANTAGES.get(name).from_context(ctx)
    batch = only(batch_with_everything(), estimator.reads)
    advantages = estimator(batch)
    assert advantages.shape == (ROWS, WIDTH) and advantages.dtype == torch.float32
    assert torch.isfinite(advantages).all()
    assert (advantages[~batch.response_mask] == 0).all()
    assert (advantages[batch.response_mask] != 0).any()
    assert all(isinstance(value, float) for value in estimator.metrics().values())
