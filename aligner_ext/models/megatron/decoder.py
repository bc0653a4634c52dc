"""The rollout engine's model side on the Megatron GPTModel's own tensor-parallel shards.

`MegatronGenerationModel` is what the Megatron backend hands the rollout engine instead of an HF
copy of the policy: the GPTModel the optimizer updates, with the HF config. The engine asks it for
its decoder (`rollout_decoder`), a `generation.decoder.Decoder` whose layer weights are the
GPTModel's parameters themselves (nothing copied, nothing to sync after an optimizer step):

- each rank holds its shard of every layer: its K/V groups and their query heads (the fused q/k/v
  matrix in Megatron's per-group layout, `Shape.qkv_per_group`), its columns of the MLP. The KV
  cache holds only this rank's K/V heads, so it shrinks with TP like the weights;
- the attention's and the MLP's output projections are row-parallel: each rank's partial output is
  summed over the TP group (`reduce`, one all-reduce each per layer, as in training's forward);
- the vocabulary-parallel embedding looks up the ids in this rank's rows and sums over the group;
  the output head's logits over this rank's vocabulary rows are all-gathered, and the padded rows
  past the real vocabulary dropped.

So every rank of a TP group computes the same logits and, from the same seeds, samples the same
tokens: the ranks of a TP group decode the same requests in lockstep (the rank split shares a call's
requests over the data-parallel groups only, `generation/sharded.py`). The rotary embedding is
computed here (HF's default RoPE; `model.rope_theta` refuses scaled variants) from each token's own
position, as in the HF decoder.

Pipeline parallelism is not served yet: a stage holds only its layers, and decoding needs them all
(the error says so; generate with `generator.engine=hf` on the refitted HF copy there).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

from aligner_ext.generation.decoder import Decoder, LayerWeights, Projection, Shape
from aligner_ext.models.megatron.model import output_weight, rope_theta


class MegatronGenerationModel(torch.nn.Module):
    """The GPTModel (a submodule, so `parameters()`, `eval()` and `train()` reach it) with the HF
    config and generation config the engine reads (EOS ids, architecture)."""

    def __init__(self, core: torch.nn.Module, hf_config, generation_config):
        super().__init__()
        self.core = core
        self.config = hf_config
        self.generation_config = generation_config
        # the rank split shares requests over this group: the TP ranks of one DP rank decode together
        self.split_group = parallel_state.get_data_parallel_group()

    def rollout_decoder(self, compile: bool = False, fuse_projections: bool = False, attention: str = "sdpa"):
        """The rollout engine's decoder over these shards (`fuse_projections` is moot: Megatron's
        q/k/v and gate/up matrices are fused already)."""
        return MegatronDecoder(self, compile=compile, attention=attention)


def inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of default RoPE, as transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, s, head_dim] at `positions` [b, s] (angles in float32, the halves repeated, cast
    to the model's dtype, as transformers does)."""
    angles = positions.float()[..., None] * inv_freq
    table = torch.cat([angles, angles], dim=-1)
    return table.cos().to(dtype), table.sin().to(dtype)


class MegatronDecoder(Decoder):
    """Prefill and decode over this rank's shards of a GPTModel (module docstring)."""

    def __init__(self, model: MegatronGenerationModel, compile: bool = False, attention: str = "sdpa"):
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("the rollout engine on the Megatron model needs pipeline_model_parallel_size=1 (a "
                             "stage holds only its layers); use generator.engine=hf with pipeline parallelism")
        self.model = model
        core = model.core
        config = core.config
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tensor_parallel, self.tensor_rank = tp, parallel_state.get_tensor_model_parallel_rank()
        layers = core.decoder.layers
        self.shape = Shape(config.num_attention_heads // tp, config.num_query_groups // tp, config.kv_channels,
                           layers[0].input_layernorm.eps, qkv_per_group=True)
        self.scale = 1.0 / math.sqrt(config.kv_channels)
        self.layers = [self._weights(layer) for layer in layers]
        self.embedding = core.embedding.word_embeddings.weight  # [V_padded / TP, H]
        self.final_norm = core.decoder.final_layernorm
        self.output = output_weight(core)
        self.vocab_size = model.config.vocab_size
        self.inv_freq = inverse_frequencies(config.kv_channels, rope_theta(model.config), self.embedding.device)
        if tp > 1:
            self.reduce = self._sum_over_group
        super().__init__(compile, attention)

    @staticmethod
    def _weights(layer) -> LayerWeights:
        attention, mlp = layer.self_attention, layer.mlp
        qkv = attention.linear_qkv
        # the local spec puts an IdentityOp where a model has no q/k norm (Qwen3 has them)
        q_norm, k_norm = (getattr(norm, "weight", None) for norm in (attention.q_layernorm, attention.k_layernorm))
        fc1 = mlp.linear_fc1.weight
        return LayerWeights(
            layer.input_layernorm.weight, Projection((qkv.weight,), (qkv.bias,), (qkv.weight.shape[0],)),
            q_norm, k_norm, attention.linear_proj.weight, None, layer.pre_mlp_layernorm.weight,
            Projection((fc1,), (None,), (fc1.shape[0] // 2, fc1.shape[0] // 2)), mlp.linear_fc2.weight, None)

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    def _sum_over_group(self, partial: torch.Tensor) -> None:
        dist.all_reduce(partial, group=self.group)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor):
        if self.reduce is None:
            hidden = F.embedding(ids, self.embedding)
        else:  # this rank's vocabulary rows: the ids outside them look up zeros, the sum fills them in
            rows = self.embedding.shape[0]
            local = ids - self.tensor_rank * rows
            outside = (local < 0) | (local >= rows)
            hidden = F.embedding(local.masked_fill(outside, 0), self.embedding).masked_fill(outside[..., None], 0.0)
            self.reduce(hidden)
        return hidden, rotary_tables(positions, self.inv_freq, hidden.dtype)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.final_norm(hidden), self.output)  # [b, V_padded / TP]
        if self.tensor_parallel > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tensor_parallel)]
            dist.all_gather(parts, logits, group=self.group)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.vocab_size]
