"""The expert products of a mixture of experts in the HF backend's model, compiled on a GPU.

transformers runs a mixture of experts' stacked experts through its `grouped_mm` implementation: two
grouped matrix products, and around them the tokens sorted by expert, their rows gathered, SwiGLU over
the halves of the gate/up product, the weighted rows put back in token order and summed, each an eager
kernel (and their backwards: a sort-based scatter for the gather). At the `moe` benchmark's layer
shape those kernels took 3 to 4 times the two products' time (scripts/bench/moe_experts.py,
docs/benchmarks.md). The same function through torch.compile (shapes dynamic) fuses them: 0.84x the
eager layer's time at 3,072 tokens, 0.55x at 12,288, against Liger-Kernel's fused MoE 1.14x / 0.56x
(with a host sync per call) and a hand-written version with custom gathers 1.07x / 0.69x.

`IMPLEMENTATION` is registered with transformers' `ExpertsInterface` and set on the model's config
(`config._experts_implementation`), so the experts module itself, its parameters and checkpoints stay
transformers' own. The compiled function runs where the hidden states are on a CUDA device and hold at
least two tokens (a one-token input, a decode step of one sequence, would compile a graph specialised
to size 1; it and CPU inputs take transformers' function as it is).
"""

from __future__ import annotations

from aligner_ext.models.kernels import compiled_on_cuda

IMPLEMENTATION = "aligner_ext_compiled_grouped_mm"


def compiled_grouped_mm():
    """transformers' `grouped_mm_experts_forward`, compiled on first use where it applies (module docstring;
    its hidden states, the argument after the module, decide)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    return compiled_on_cuda(grouped_mm_experts_forward, tensor_argument=1)


def compile_experts(model) -> bool:
    """Give `model`'s stacked experts the compiled implementation, where transformers dispatches them
    through its `ExpertsInterface` (`grouped_mm` is their implementation); whether it did."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        return False
    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, compiled_grouped_mm())
    model.set_experts_implementation(IMPLEMENTATION)
    return True
