"""Every registered loss: the sum of its micro-batch losses (with the step's global counts) equals the
full-batch loss, in value and gradient, with a KL term and with an off-policy correction too. A new loss
is covered as soon as it registers (built with an aggregation mode and a correction it defines)."""

import pytest
import torch

import aligner_ext.plugins  # noqa: F401 - registers the built-in plug-ins
from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import load_config
from aligner_ext.context import BuildContext
from aligner_ext.data.types import PromptRow
from aligner_ext.losses.base import LOSSES


def batch_with_everything(rows=5, width=4, seed=0) -> tuple[ExperienceBatch, torch.Tensor]:
    """A batch of ragged responses with advantages, old and reference log-probs; plus a parameter
    tensor whose log-softmax gives the current log-probs."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4, 1, 3, 2, 4])
    valid = torch.arange(width)[None, :] < lengths[:, None]
    params = torch.randn(rows, width, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (rows, width), generator=gen)
    current = torch.log_softmax(params, dim=-1).gather(2, targets[..., None]).squeeze(2).detach()
    batch = ExperienceBatch(
        prompt_ids=torch.ones(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
        response_ids=targets, response_valid=valid, response_mask=valid.clone(),
        group_ids=torch.tensor([0, 0, 1, 1, 1]),
        samples=[SampleInfo(row=PromptRow(row_id=f"c:{i}", messages=[], data_source="c")) for i in range(rows)],
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]), correct=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]),
        advantages=torch.randn(rows, width, generator=gen, dtype=torch.float64) * valid,
        old_logprobs=current + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64),
        ref_logprobs=current + 0.2 * torch.randn(rows, width, generator=gen, dtype=torch.float64),
        generation_logprobs=current + 0.2 * torch.randn(rows, width, generator=gen, dtype=torch.float64),
    )
    return batch, params


def loss_value_and_grad(loss, batch, params, splits):
    counts = loss.global_counts(batch)
    params.grad = None
    total = 0.0
    for rows in splits:
        micro = batch.select(rows)
        logprobs = torch.log_softmax(params[rows], dim=-1).gather(2, micro.response_ids[..., None]).squeeze(2)
        value, _ = loss(logprobs, micro, counts)
        value.backward()
        total += value.item()
    return total, params.grad.clone()


@pytest.mark.parametrize("name", LOSSES.names())
@pytest.mark.parametrize("overrides", [[], ["loss.kl_coef=0.1", "loss.agg_mode=seq-mean-token-mean"],
                                       ["loss.off_policy_correction=sequence_tis", "loss.importance_sampling_cap=2"]])
def test_micro_batch_split_does_not_change_loss_or_gradient(name, overrides):
    cls = LOSSES.get(name)
    defined = getattr(cls, "agg_modes", None)
    if defined and not any(o.startswith("loss.agg_mode=") for o in overrides) and "token-mean" not in defined:
        overrides = overrides + [f"loss.agg_mode={defined[0]}"]  # a loss that does not define the default mode
    cfg = load_config("base", [f"algorithm.loss={name}", *overrides])
    loss = cls.from_context(BuildContext(cfg=cfg, tokenizer=None, policy=None, engine=None, rewards=None))
    batch, params = batch_with_everything()
    whole, whole_grad = loss_value_and_grad(loss, batch, params, [[0, 1, 2, 3, 4]])
    split, split_grad = loss_value_and_grad(loss, batch, params, [[0], [1, 2], [3, 4]])
    assert whole_grad.abs().sum() > 0
    assert split == pytest.approx(whole, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-10, atol=1e-12)
