"""What the routers of a mixture of experts did in a training forward on the Megatron backend: per
layer, the largest expert load relative to an even one and the router's mean entropy, the metrics the
HF backend reports (`models/moe.py`, `moe/load_max/layer_N`, `moe/router_entropy/layer_N` and their
means), pooled over the real tokens of the whole mini-batch.

`RouterRecorder` wraps each megatron-core router's `gating` (the router logits [s, b, experts] of its
layer) and, while a micro-batch's forward runs (`begin` / `end`, called by forward.py around the
stage's forward), adds them into the HF backend's `RouterTally` over that micro-batch's real tokens
(`Packed.real`; pads and filler rows excluded). A layer
recomputed in the backward (`policy.recompute_activations`) runs its router again outside any
micro-batch's forward, and is not counted twice. `take` sums the tally over every rank (DP ranks
hold other rows, TP ranks other sequence shards under sequence parallelism, PP stages other layers),
so every rank returns the same metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from aligner_ext.models.moe import RouterTally


class RouterRecorder:
    """The expert loads and router entropies of the micro-batches' forwards (module docstring)."""

    def __init__(self, core: torch.nn.Module, num_layers: int, experts: int, top_k: int):
        self.tally = RouterTally(num_layers, experts, top_k, next(core.parameters()).device)
        self.real: torch.Tensor | None = None  # this micro-batch's real tokens in the routers' order, during its forward
        for router in (module for module in core.modules() if isinstance(module, TopKRouter)):
            router.gating = self._recorded(router.gating, router.layer_number - 1)

    def _recorded(self, gating, layer: int):
        def recorded(hidden: torch.Tensor) -> torch.Tensor:
            logits = gating(hidden)
            if self.real is not None:
                self.tally.add(layer, logits.reshape(-1, logits.shape[-1]), self.real)
            return logits

        return recorded

    def begin(self, real: torch.Tensor) -> None:
        """A micro-batch's forward starts; `real` [b, s] marks its real tokens (the whole sequence, as
        every rank of a TP group holds it; this rank's sequence shard is taken here)."""
        tokens = real.transpose(0, 1)  # the routers see [s, b] flattened
        if parallel_state.get_tensor_model_parallel_world_size() > 1:  # sequence parallelism: this rank's rows
            shard = tokens.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
            start = parallel_state.get_tensor_model_parallel_rank() * shard
            tokens = tokens[start:start + shard]
        self.real = tokens.reshape(-1)

    def end(self) -> None:
        self.real = None

    def take(self) -> dict[str, float]:
        """The metrics of everything recorded since the last call, the same on every rank; then reset."""
        totals = self.tally.totals()
        dist.all_reduce(totals)
        return self.tally.metrics(totals)
