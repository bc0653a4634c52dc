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
"""

from __future__ import annotations

import importlib

import torch

from aligner_ext.errors import ConfigError


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
        """Layer `layer`'s router logits [tokens, experts] at the tokens where `real` [tokens] is True."""
        logits = logits.detach().float()[real.to(logits.device)]
        log_probs = torch.log_softmax(logits, dim=-1)
        self.entropy[layer] += -(log_probs.exp() * log_probs).sum()
        choices = logits.topk(self.top_k, dim=-1).indices.flatten()
        self.counts[layer] += torch.bincount(choices, minlength=logits.shape[-1]).double()
        self.tokens[layer] += logits.shape[0]

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

