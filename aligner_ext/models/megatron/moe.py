"""What the routers of a mixture of experts did in a training forward on the Megatron backend: per
layer, the largest expert load relative to an even one and the router's mean entropy, the metrics the
HF backend reports (`models/moe.py`, `moe/load_max/layer_N`, `moe/router_entropy/layer_N` and their
means), pooled over the real tokens of the whole mini-batch.

`RouterRecorder` wraps each megatron-core router's `gating` (the router logits [s, b, experts] of its
layer) and, while a micro-batch's forward runs (`begin` / `end`, called by forward.py around the
stage's forward), adds up per layer the top-k choices per expert, the summed entropy and the token
count over that micro-batch's real tokens (`Packed.real`; pads and filler rows excluded). A layer
recomputed in the backward (`policy.recompute_activations`) runs its router again outside any
micro-batch's forward, and is not counted twice. `take` sums the counts over every rank (DP ranks
hold other rows, TP ranks other sequence shards under sequence parallelism, PP stages other layers),
so every rank returns the same metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from aligner_ext.models.moe import layer_metrics


class RouterRecorder:
    """The expert loads and router entropies of the micro-batches' forwards (module docstring)."""

    def __init__(self, core: torch.nn.Module, num_layers: int, experts: int, top_k: int):
        self.top_k = top_k
        device = next(core.parameters()).device
        self.counts = torch.zeros(num_layers, experts, dtype=torch.float64, device=device)  # top-k choices per expert
        self.entropy = torch.zeros(num_layers, dtype=torch.float64, device=device)  # summed over tokens
        self.tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.real: torch.Tensor | None = None  # this micro-batch's real tokens in the routers' order, during its forward
        for router in (module for module in core.modules() if isinstance(module, TopKRouter)):
            router.gating = self._recorded(router.gating, router.layer_number - 1)

    def _recorded(self, gating, layer: int):
        def recorded(hidden: torch.Tensor) -> torch.Tensor:
            logits = gating(hidden)
            if self.real is not None:
                self._add(layer, logits.detach())
            return logits

        return recorded

    @torch.no_grad()
    def _add(self, layer: int, logits: torch.Tensor) -> None:
        logits = logits.reshape(-1, logits.shape[-1]).float()[self.real]
        log_probs = torch.log_softmax(logits, dim=-1)
        self.entropy[layer] += -(log_probs.exp() * log_probs).sum()
        choices = logits.topk(self.top_k, dim=-1).indices.flatten()
        self.counts[layer] += torch.bincount(choices, minlength=logits.shape[-1]).double()
        self.tokens[layer] += logits.shape[0]

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
        totals = torch.cat([self.counts.flatten(), self.entropy, self.tokens])
        dist.all_reduce(totals)
        layers, experts = self.counts.shape
        counts = totals[:layers * experts].view(layers, experts)
        entropy, tokens = totals[layers * experts:].split(layers)
        loads = (counts.max(dim=1).values / counts.sum(dim=1).clamp(min=1) * experts).tolist()
        entropies = (entropy / tokens.clamp(min=1)).tolist()
        for tensor in (self.counts, self.entropy, self.tokens):
            tensor.zero_()
        return layer_metrics(loads, entropies)
