"""Adam's step count after a distributed-optimizer resume (models/megatron/dist_checkpoint.py).

megatron-core 0.16 hands every parameter one shared step tensor when it loads a distributed
optimizer's state into torch's Adam; torch increments a step tensor once per parameter holding it.
The distributed optimizer itself runs on GPUs only (scripts/bench/megatron_loop_gpu.sh at 4e17684 resumes
one and compares it with the straight run); this pins the part that runs anywhere.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.models.megatron.dist_checkpoint import restore_steps  # noqa: E402


@pytest.mark.parametrize("foreach", [False, True])
def test_each_parameter_counts_its_own_steps_after_a_restore(foreach):
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    for param in params:
        param.grad = torch.ones(3)
    optimizer.step()
    shared = torch.tensor(15.0)  # the checkpoint's step, one tensor for every parameter
    restore_steps(optimizer, {param: shared for param in params})
    optimizer.step()
    assert [optimizer.state[param]["step"].item() for param in params] == [16.0] * 4
    assert shared.item() == 15.0
