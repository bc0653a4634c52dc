"""The Megatron backend's optimizer (models/megatron/optimizer.py): under the non-finite guard a NaN
or infinite global gradient norm skips the step and is counted, a finite one is clipped and
applied; on resume the run's betas, eps and weight decay replace the saved ones. The optimizer is a
stand-in with megatron-core's stage methods and param groups, so this runs anywhere."""

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.models.base import NonFiniteGuard  # noqa: E402
from aligner_ext.models.megatron.optimizer import clipped_step  # noqa: E402


class StagedOptimizer:
    """megatron-core's optimizer stages: prepare_grads (True: inf found by a loss scaler), the global
    gradient norm, then the step."""

    def __init__(self, norm: float, found_inf: bool = False):
        self.norm, self.found_inf, self.stepped = norm, found_inf, False
        self.param = torch.nn.Parameter(torch.zeros(2))
        self.param.grad = torch.tensor([3.0, 4.0])

    def prepare_grads(self):
        return self.found_inf

    def get_grad_norm(self):
        return self.norm

    def get_parameters(self):
        return [self.param]

    def step_with_ready_grads(self):
        self.stepped = True
        return True


@pytest.mark.parametrize("norm, found_inf", [(math.nan, False), (math.inf, False), (5.0, True)])
def test_a_non_finite_step_is_skipped_and_counted(norm, found_inf):
    guard = NonFiniteGuard(limit=3)
    optimizer = StagedOptimizer(norm, found_inf)
    assert clipped_step(optimizer, 1.0, guard.admit) is None
    assert not optimizer.stepped and guard.state_dict() == {"in_a_row": 1, "skipped": 1}


def test_a_finite_step_is_clipped_and_applied():
    guard = NonFiniteGuard(limit=3)
    optimizer = StagedOptimizer(5.0)  # the gradient [3, 4] has norm 5
    assert clipped_step(optimizer, 1.0, guard.admit) == 5.0
    assert optimizer.stepped and guard.state_dict() == {"in_a_row": 0, "skipped": 0}
    assert torch.allclose(optimizer.param.grad, torch.tensor([0.6, 0.8]), atol=1e-6)  # scaled to norm 1


def test_a_resume_applies_changed_betas_eps_and_weight_decay_keeping_exempt_groups():
    from types import SimpleNamespace

    from aligner_ext.models.settings import OptimConfig
    from aligner_ext.models.megatron.optimizer import apply_settings

    groups = [{"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "wd_mult": 1.0, "lr": 1e-3},
              {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "wd_mult": 0.0, "lr": 1e-3}]
    apply_settings(SimpleNamespace(param_groups=groups), OptimConfig(beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.1))
    assert [g["betas"] for g in groups] == [(0.5, 0.9)] * 2 and [g["eps"] for g in groups] == [1e-6] * 2
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # biases and norms stay exempt
    assert [g["lr"] for g in groups] == [1e-3, 1e-3]  # the learning rate is set_lr's
