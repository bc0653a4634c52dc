"""Megatron-core policy backend (extra `megatron`): GPTModel built from an HF config, HF <-> Megatron
weight conversion with TP/PP sharding, and vocab-parallel log-probs.

Modules (docs/megatron.md):
- `parallel`: torch.distributed + megatron-core process groups from the torchrun environment.
- `cpu_shims`: the three patches megatron-core needs to run on CPU under gloo (tests, CI).
- `model`: TransformerConfig + GPTModel (local layer spec, attention through torch SDPA).
- `convert`: HF <-> Megatron state dicts, per (pipeline stage, tensor rank) shard.
- `shard_files`: those shards as directories on disk, and the conversion command line
  (`scripts/convert_checkpoint.py`).
- `logprobs`: log-probs and entropy of response tokens over vocab-sharded logits.

- `forward`: micro-batches through megatron-core's schedules (`get_forward_backward_func`).
- `optimizer`: megatron-core DDP (sum over DP) and AdamW.
- `weights`: the full HF state dict gathered from the shards, in memory.
- `dist_checkpoint`: weights and optimizer state in megatron-core's distributed checkpoint format.
- `policy`: `MegatronPolicy`, the `Policy` interface on all of the above.

This package file imports nothing from megatron-core: it only registers the backend name, and
the policy module is imported when a run asks for `policy.backend=megatron`, so megatron-core
stays an optional extra and HF-only runs do not pay for importing it.
"""

from aligner_ext.models.base import POLICIES


@POLICIES.register("megatron")
def megatron_policy(model, cfg, total_steps: int):
    """Build `policy.MegatronPolicy` (imports megatron-core on first use)."""
    from aligner_ext.models.megatron.policy import MegatronPolicy

    return MegatronPolicy(model, cfg, total_steps)
