"""Float32 master weights for a bf16 or fp16 policy on the HF backend (`policy.optim.master_weights`).

AdamW's step is about `lr` per element, while a bf16 weight of magnitude 0.02-0.1 is spaced 1e-4 to
5e-4 apart: applied to bf16 weights, an update at a typical RL learning rate (1e-6) rounds away for
most elements, and the run does not train. So the optimizer holds float32 copies of the
low-precision trainable weights (its moments are float32 with them), the forward and backward run
on the model's own bf16 weights, each weight's gradient is added into its master's float32 gradient
as soon as the backward produces it (the bf16 gradient is then freed, so gradients accumulate over
micro-batches in float32), and after each optimizer step the masters are rounded into the model's
weights, which the rollout engine computes from in place. The mixed precision of megatron-core's
optimizer, which the Megatron backend uses.

Memory per trainable parameter: bf16 weight 2 + float32 master 4 + its gradient 4 + AdamW's two
moments 8 = 18 bytes (plus a bf16 gradient while the backward holds it), against 8 for AdamW on the
bf16 weights (docs/configuration.md, `policy.optim.master_weights`).
"""

from __future__ import annotations

import torch

from aligner_ext.errors import CheckpointError

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """The weights the optimizer updates for `params` (a model's trainable tensors): a float32 copy of
    each low-precision one, the tensor itself for the others (float32 LoRA adapters, float32 models)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.pairs = [(param, param.detach().float()) for param in params if param.dtype in LOW_PRECISION]
        masters = {id(param): master for param, master in self.pairs}
        self.weights = [masters.get(id(param), param) for param in params]
        for param, master in self.pairs:
            param.register_post_accumulate_grad_hook(self._into_master(master))

    @staticmethod
    def _into_master(master: torch.Tensor):
        """A hook moving a weight's freshly accumulated gradient into `master`'s float32 gradient."""

        def hook(param: torch.nn.Parameter) -> None:
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return hook

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's weights (after an optimizer step, and after a resume)."""
        if self.pairs:
            torch._foreach_copy_([param for param, _ in self.pairs], [master for _, master in self.pairs])

    def state_dict(self) -> list[torch.Tensor]:
        return [master for _, master in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor] | None) -> None:
        """The checkpoint's masters, into the model's weights too; None (a checkpoint of a run without
        masters: float32, or written before they existed): the masters from the weights it loaded."""
        if masters is None:
            for param, master in self.pairs:
                master.copy_(param)
            return
        if len(masters) != len(self.pairs):
            raise CheckpointError(f"the checkpoint holds {len(masters)} float32 master weights, this policy trains "
                                  f"{len(self.pairs)} low-precision tensors (another model or policy.lora?)")
        torch._foreach_copy_([master for _, master in self.pairs], list(masters))
        self.copy_to_model()
