"""Mixture-of-experts policies on the HF backend: what their routers did in a training forward, and
their load-balancing loss as an option (docs/models.md, "Mixtures of experts").

transformers returns each MoE layer's router logits [tokens, experts] when the forward is asked for
them (`output_router_logits=True`); the training forward asks whenever the policy is a mixture of
experts (`is_moe`). From them, over the real tokens of the mini-batch (pads excluded; `RouterTally`):
- the expert load of each layer: the share of the top-k choices each expert took; the metric is the
  largest share times the number of experts (1.0 when every expert gets the same share; at most
  experts / k, when k experts take everything);
- the router's entropy per layer, of its softmax over all experts, in nats (log(experts) at most);
- the load-balancing loss (`policy.router_aux_loss_coef` times transformers' own
  `load_balancing_loss_func`, Switch Transformer's E * sum_e f_e P_e), added to the policy loss when
  the coefficient is above 0. Off by default, as most RL runs of these models leave it.

The rollout engine records the experts its routers chose for every token it fed through the model
(`ExperienceBatch.prompt_routing` / `response_routing`); `engine_routing` hooks each router for a
forward (and its backward, which recomputes layers under activation checkpointing) over such a batch:
- the mismatch (`RoutingMismatch`): in the first forward over the step's tokens (the old-log-prob
  pass, or the training forward when it gives the old log-probs), the share of (token, layer) pairs
  whose top-k set of experts differs between the trainer's router and the engine's, over the tokens
  the engine recorded (`moe/routing_mismatch`, per layer, and the share of tokens with a difference
  in any layer, `moe/routing_mismatch_tokens`);
- routing replay (`policy.routing_replay`): the router returns the engine's experts instead of its
  own top k, weighted by its own probabilities at them (softmax in float32 over all experts, gathered,
  renormalised where the model renormalises its top k, cast back), so the gradient reaches the router
  through those weights as it does through transformers' top-k weights. The expert load, router
  entropy and load-balancing loss above stay those of the router's own logits.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from aligner_ext.batch import host_to_device
from aligner_ext.errors import ConfigError
from aligner_ext.generation.base import NOT_RECORDED


def is_moe(config) -> bool:
    """A model whose MLPs route tokens to experts (Qwen2-MoE, Qwen3-MoE, Mixtral, ...)."""
    return bool(getattr(config, "num_experts_per_tok", 0)) and experts(config) > 0


def experts(config) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def check_aux_loss(config, coefficient: float) -> None:
    """A load-balancing loss needs a router: refused in one line for a dense model."""
    if coefficient > 0 and not is_moe(config):
        raise ConfigError(f"policy.router_aux_loss_coef={coefficient:g}: the model ({config.model_type}) has no "
                          "router; the load-balancing loss is for mixture-of-experts models")


class RouterTally:
    """What the routers did over the real tokens added so far, per layer: the top-k choices each
    expert took, the summed entropy of the router's softmax and the token count, on the logits'
    device (no host sync until `metrics`). Both backends report from it (models/megatron/moe.py sums
    its totals over the ranks first), so their metrics pool the same tokens the same way."""

    def __init__(self, layers: int, experts: int, top_k: int, device: torch.device):
        self.top_k = top_k
        self.counts = torch.zeros(layers, experts, dtype=torch.float64, device=device)
        self.entropy = torch.zeros(layers, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(layers, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, layer: int, logits: torch.Tensor, real: torch.Tensor) -> None:
        """Layer `layer`'s router logits [tokens, experts] at the tokens where `real` [tokens] is True.
        Pads are weighted 0 rather than indexed out, and choices counted by index_add_, not bincount:
        both of those wait for the device (a host sync per layer and micro-batch stalls the training
        forward's kernel launches)."""
        logits = logits.detach().float()
        weight = real.to(logits.device, torch.float64)
        log_probs = torch.log_softmax(logits, dim=-1)
        self.entropy[layer] += (-(log_probs.exp() * log_probs).sum(dim=-1).double() * weight).sum()
        choices = logits.topk(self.top_k, dim=-1).indices.flatten()
        self.counts[layer].index_add_(0, choices, weight.repeat_interleave(self.top_k))
        self.tokens[layer] += weight.sum()

    def totals(self) -> torch.Tensor:
        """Everything tallied as one flat tensor (to sum over ranks in place: it is a copy)."""
        return torch.cat([self.counts.flatten(), self.entropy, self.tokens])

    def metrics(self, totals: torch.Tensor | None = None) -> dict[str, float]:
        """Per layer and averaged over the layers: the largest expert load relative to an even one and
        the router's mean entropy, from `totals` (default: this tally's own); then reset."""
        totals = self.totals() if totals is None else totals
        layers, experts = self.counts.shape
        counts = totals[:layers * experts].view(layers, experts)
        entropy, tokens = totals[layers * experts:].split(layers)
        loads = (counts.max(dim=1).values / counts.sum(dim=1).clamp(min=1) * experts).tolist()
        entropies = (entropy / tokens.clamp(min=1)).tolist()
        for tensor in (self.counts, self.entropy, self.tokens):
            tensor.zero_()
        stats = {f"moe/load_max/layer_{layer}": load for layer, load in enumerate(loads)}
        stats.update({f"moe/router_entropy/layer_{layer}": value for layer, value in enumerate(entropies)})
        stats["moe/load_max"] = sum(loads) / len(loads)
        stats["moe/router_entropy"] = sum(entropies) / len(entropies)
        return stats


def load_balancing_loss(model, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """transformers' load-balancing loss of the model's family, over the real tokens (`attention_mask`
    [b, s] of the padded micro-batch; None for a packed one, whose tokens are all real)."""
    module = importlib.import_module(type(model).__module__)
    config = model.config
    return module.load_balancing_loss_func(router_logits, experts(config), config.num_experts_per_tok, attention_mask)


class RoutingMismatch:
    """How often the trainer's routers chose another top-k set of experts than the engine's, over the
    (token, layer) pairs the engine recorded, per layer, and over tokens (any layer differs); on the
    device, no host sync until `metrics` (module docstring)."""

    def __init__(self, layers: int, device: torch.device):
        self.differing = torch.zeros(layers, dtype=torch.float64, device=device)
        self.compared = torch.zeros(layers, dtype=torch.float64, device=device)
        self.differing_tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, layer: int, trainer: torch.Tensor, engine: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s top-k experts [tokens, k] of the trainer and the engine, compared as sets where
        `recorded` [tokens]; returns which tokens differ [tokens] bool."""
        differs = (trainer.sort(dim=-1).values != engine.sort(dim=-1).values).any(dim=-1) & recorded
        self.differing[layer] += differs.sum()
        self.compared[layer] += recorded.sum()
        return differs

    @torch.no_grad()
    def add_tokens(self, differs: torch.Tensor, recorded: torch.Tensor) -> None:
        """One forward's tokens [tokens] bool: a difference in some layer, and recorded by the engine."""
        self.differing_tokens += differs.sum()
        self.tokens += recorded.sum()

    def metrics(self) -> dict[str, float]:
        """The shares since the last call (none where nothing was compared); then reset."""
        differing, compared = self.differing.tolist(), self.compared.tolist()
        tokens = [float(self.differing_tokens), float(self.tokens)]
        for tensor in (self.differing, self.compared, self.differing_tokens, self.tokens):
            tensor.zero_()
        if not sum(compared):
            return {}
        stats = {f"moe/routing_mismatch/layer_{layer}": part / max(whole, 1)
                 for layer, (part, whole) in enumerate(zip(differing, compared))}
        stats["moe/routing_mismatch"] = sum(differing) / sum(compared)
        stats["moe/routing_mismatch_tokens"] = tokens[0] / tokens[1]
        return stats


class _EngineChoices:
    """The forward hook `engine_routing` puts on each MoE layer's router."""

    def __init__(self, routing: torch.Tensor, replay: bool, mismatch: RoutingMismatch | None):
        self.routing, self.replay, self.mismatch = routing, replay, mismatch
        self.recorded = routing[:, 0, 0] != NOT_RECORDED  # [tokens]
        self.differs = torch.zeros_like(self.recorded)  # tokens whose experts differ in some layer
        self.measured: set[int] = set()  # layers compared: a recomputation in the backward is not

    def __call__(self, layer: int, router: torch.nn.Module, output: tuple) -> tuple | None:
        logits, _, indices = output
        if logits.shape[0] != self.routing.shape[0]:
            raise ValueError(f"the engine's routing covers {self.routing.shape[0]} tokens, the forward has "
                             f"{logits.shape[0]}")
        engine = self.routing[:, layer]
        if self.mismatch is not None and layer not in self.measured:
            self.measured.add(layer)
            self.differs |= self.mismatch.add(layer, indices, engine, self.recorded)
        if not self.replay:
            return None
        chosen = torch.where(self.recorded[:, None], engine, indices)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, chosen)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen


@contextmanager
def engine_routing(model, routing: torch.Tensor | None, replay: bool,
                   mismatch: RoutingMismatch | None) -> Iterator[None]:
    """For the forwards and backwards inside: each MoE layer's router of `model` compared with
    (`mismatch`) and, with `replay`, replaced by the engine's experts `routing` [tokens, layers, k], the
    forward's tokens in the order the routers see them (NOT_RECORDED tokens keep the router's own).
    Nothing where `routing` is None or there is nothing to do."""
    if routing is None or not (replay or mismatch is not None):
        yield
        return
    choices = _EngineChoices(host_to_device(routing, model.device).long(), replay, mismatch)
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda router, args, output, layer=index: choices(layer, router, output))
        for index, layer in enumerate(model.get_decoder().layers)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    if mismatch is not None:
        mismatch.add_tokens(choices.differs, choices.recorded)
