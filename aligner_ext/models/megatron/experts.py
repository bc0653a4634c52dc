"""A mixture of experts' local experts in two grouped matrix products, on megatron-core's own parameters.

megatron-core's local spec (no Transformer Engine, as here) runs a layer's local experts with
`SequentialMLP`: one MLP per expert, one after another, each its own fc1, activation and fc2 kernels,
after a host sync for the tokens per expert. At a Qwen3-30B-A3B layer (64 local experts at EP=2, a few
hundred tokens each) that is thousands of small kernels per step; the Megatron backend trained such a
model at 4.7% MFU (docs/benchmarks.md, "Multi-GPU table").

`GroupedExperts` is `SequentialMLP` with the same modules and parameters (so conversion, checkpoints,
the rollout engine's reading of `local_experts.{e}.linear_fc1.weight` and expert parallelism are
unchanged) and a forward that stacks the local experts' fc1 and fc2 weights and runs
`torch._grouped_mm` over the tokens sorted by expert, as megatron-core's dispatcher hands them over:
fc1, SwiGLU scaled by each token's routing weight (the same functions `MLP.forward` applies: the fused
`weighted_bias_swiglu_impl` where `bias_activation_fusion` is set, else the unfused formula), fc2. The
expert linears do no communication of their own (megatron-core's dispatcher gathers and reduces
around them), so the local products are the whole of what `SequentialMLP` computes. The stacked
weights are a copy per forward: one read and write of the local experts' weights, small beside the
products at a training micro-batch.

It falls back to `SequentialMLP.forward` where the grouped form would compute something else or cannot
run (`grouped_form_runs`): one local expert, an activation other than SwiGLU, biases, fp8, routing weights
applied on the input, a forward hook on an expert's linear (an adapter's), or a dtype `torch._grouped_mm`
does not take (bfloat16 anywhere; float32 on the CPU, where the tests check the two forms agree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP


class GroupedExperts(SequentialMLP):
    """`SequentialMLP` whose forward is two grouped products over its local experts (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config  # what the config decides once; hooks and dtypes are read at each forward
        swiglu = (config.gated_linear_unit and config.activation_func is F.silu and not config.add_bias_linear
                  and config.activation_func_clamp_value is None and config.glu_linear_offset == 0)
        plain = not (config.fp8 or config.fp4 or config.moe_apply_probs_on_input or config.use_te_activation_func)
        self.grouped_config = self.num_local_experts > 1 and swiglu and plain

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        hidden = permuted_local_hidden_states
        if not self.grouped_form_runs(hidden):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        ends = torch.cumsum(tokens_per_expert.to(hidden.device), dim=0, dtype=torch.int32)
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])  # [E, 2F, H]
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])  # [E, H, F]
        gate_up = torch._grouped_mm(hidden, fc1.transpose(1, 2), offs=ends)
        return torch._grouped_mm(self.scaled_swiglu(gate_up, permuted_probs), fc2.transpose(1, 2), offs=ends), None

    def scaled_swiglu(self, gate_up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the [gate; up] halves times each token's routing weight, as `MLP.forward` computes it."""
        if self.config.bias_activation_fusion:
            return weighted_bias_swiglu_impl(gate_up, None, probs.unsqueeze(-1),
                                             self.config.activation_func_fp8_input_store)
        gate, up = torch.chunk(gate_up, 2, dim=-1)
        return (F.silu(gate) * up * probs.unsqueeze(-1)).to(gate_up.dtype)

    def grouped_form_runs(self, hidden: torch.Tensor) -> bool:
        """Whether the grouped products compute what `SequentialMLP.forward` would (module docstring)."""
        if not self.grouped_config:
            return False
        if not (hidden.dtype == torch.bfloat16 or (hidden.dtype == torch.float32 and hidden.device.type == "cpu")):
            return False
        return not any(linear._forward_hooks or linear._forward_pre_hooks for expert in self.local_experts
                       for linear in (expert.linear_fc1, expert.linear_fc2))
