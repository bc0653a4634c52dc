"""BuildContext: what a plug-in may use when `trainer/build.py` builds it.

Every registered experience maker, experience wrapper, advantage estimator and loss has a
classmethod `from_context(ctx)` (wrappers: `from_context(inner, ctx)`) that picks its own config
section out of `ctx.cfg` and the shared runtime objects it needs, then calls its constructor, which
takes only its own config and those objects. The loop never sees any of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aligner_ext.config import RunConfig
    from aligner_ext.generation.base import GenerationEngine
    from aligner_ext.models.base import Policy
    from aligner_ext.rewards.manager import RewardManager


@dataclass
class BuildContext:
    """The run config and the objects shared by all plug-ins of one run."""

    cfg: "RunConfig"
    tokenizer: Any  # the HF tokenizer of the policy
    policy: "Policy"  # the trained policy (log-prob passes of wrappers go through it)
    engine: "GenerationEngine"  # the generation engine sampling from the policy
    rewards: "RewardManager"  # scores responses by data_source
    vocab_size: int = 0  # the policy's logits per token (its output layer's rows; the policy may hold no HF model: Megatron with LoRA or generating on its shards)
    reads_after_experience: frozenset[str] = field(default_factory=frozenset)  # batch fields the advantage and loss read (a wrapper that only adds fields turns itself on for them)
