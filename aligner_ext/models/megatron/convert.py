"""HF <-> Megatron-core state dicts of every dense family `aligner_ext/architecture.py` describes, sharded
by (pipeline stage, tensor rank).

Layouts (megatron-core local spec, `model.block_spec`):
- `embedding.word_embeddings.weight`, `output_layer.weight`: vocabulary rows padded with zeros to
  `model.padded_vocab_size` and split in TP contiguous blocks (vocab-parallel).
- `self_attention.linear_qkv`: one fused column-parallel matrix in megatron's per-query-group
  layout: for each KV group g, the rows of its q heads, then k_g, then v_g
  ([groups * (heads/groups + 2) * head_dim, H]); TP rank r holds groups r*G/TP .. (r+1)*G/TP - 1
  (and so q heads r*N/TP ..), so the split is contiguous. q/k/v biases follow the same layout.
  Phi-3's checkpoint fuses them as `qkv_proj` ([q; k; v] rows): split on the way in, fused again
  on the way out.
- `self_attention.linear_proj` (o_proj) and `mlp.linear_fc2` (down_proj): row-parallel, split
  along the input dimension.
- `mlp.linear_fc1`: gate and up fused per rank: rank r holds [gate rows of r; up rows of r], since
  megatron splits the rank's output in two halves for the gated MLP. Phi-3's `gate_up_proj`
  ([gate; up] rows) is split first and fused again on the way out.
- Norm weights by role (`Architecture.norm_names`, `MEGATRON_NORMS`): input, pre-MLP, the
  post-norms on the attention's and the MLP's outputs, final; and per-head q/k norms (Qwen3, Gemma 3):
  replicated on every TP rank. OLMo's q/k norms over the whole projection ([heads * head_dim],
  [groups * head_dim]) are split like the heads: rank r holds the q norm of its q heads, the k norm
  of its K/V groups, contiguous blocks in HF's order as the heads are.
- Mixtures of experts (Qwen3-MoE, Qwen2-MoE; megatron-core's MoE layer with one MLP per expert):
  the router `mlp.gate.weight` is `mlp.router.weight`, replicated; expert e's slice of transformers'
  stacked `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and `mlp.experts.down_proj`
  [E, H, I] are `mlp.experts.local_experts.{e}.linear_fc1.weight` and `.linear_fc2.weight`, split
  over TP as a dense MLP's fc1 and fc2. Qwen2-MoE's shared expert maps like a dense MLP onto
  `mlp.shared_experts.linear_fc1` / `linear_fc2`, its gate `mlp.shared_expert_gate.weight` onto
  `mlp.shared_experts.gate_weight` (replicated). Where one Megatron tensor is one expert's slice of
  an HF tensor, `hf_tensors` names it `<HF name>#<expert>` (`EXPERT_SLICE`). Under expert
  parallelism (EP) expert-parallel rank q holds experts q*E/EP .. (q+1)*E/EP - 1 as its local experts
  0 .. E/EP - 1 (megatron-core's `num_local_experts`, local index + q*E/EP = global index); every
  other tensor is the same on every EP rank, and shards are then keyed (stage, tensor rank, EP rank).
- Pipeline: stage p holds layers p*L/PP .. (p+1)*L/PP - 1, renumbered from 0; the first stage holds
  the embedding, the last the final norm and output layer. With tied embeddings and PP > 1 the last
  stage holds its own copy of the embedding as `output_layer.weight` (megatron-core keeps the two
  in sync by all-reducing their gradients); with PP = 1 there is no `output_layer.weight`.

Round trip: `megatron_to_hf(hf_to_megatron(sd))` returns every tensor of `sd` bit for bit (only
slicing and concatenation, no arithmetic). For tied models the HF side has no `lm_head.weight`
(as `save_pretrained` writes it); one given is checked equal to the embedding and dropped.

`architecture(hf_config)` instantiates transformers' rotary module, so each public function reads
it once and hands it down (`hf_tensors` and `is_replicated` take it: the refit calls them per
parameter).
"""

from __future__ import annotations

import re

import torch

from aligner_ext.architecture import Architecture, architecture, head_dim
from aligner_ext.models.megatron.model import padded_vocab_size

Shards = dict[tuple[int, ...], dict[str, torch.Tensor]]  # (pipeline stage, tensor rank[, EP rank]) -> state dict
LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")  # a stage's layer parameter: local layer, suffix

# Megatron's layer norm weights by role (the roles of `Architecture.norm_names`).
MEGATRON_NORMS = {
    "input": "input_layernorm.weight",
    "pre_mlp": "pre_mlp_layernorm.weight",
    "post_attention": "self_attention.output_norm.weight",
    "post_mlp": "mlp.output_norm.weight",
}
REPLICATED_SUFFIXES = (*MEGATRON_NORMS.values(), "final_layernorm.weight", "mlp.router.weight",
                       "mlp.shared_experts.gate_weight")
EXPERT_SLICE = "#"  # "<HF name>#<expert>": one expert's slice of a stacked HF tensor (module docstring)
CHECKPOINT_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


def layer_tensors(arch: Architecture) -> tuple[tuple[str, str, str], ...]:
    """(HF suffix, megatron suffix, how it is split over TP) of each per-layer tensor that maps one to one."""
    tensors = [(f"{arch.norm_names[role]}.weight", MEGATRON_NORMS[role], "replicated") for role in arch.norm_roles]
    tensors += [("self_attn.o_proj.weight", "self_attention.linear_proj.weight", "row")]
    if arch.experts is None:
        tensors.append(("mlp.down_proj.weight", "mlp.linear_fc2.weight", "row"))
    else:
        tensors.append(("mlp.gate.weight", "mlp.router.weight", "replicated"))
        if arch.experts.shared_ffn_size:
            tensors += [("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", "row"),
                        ("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight", "replicated")]
    if arch.qk_norm:
        how = "replicated" if arch.qk_norm == "head" else "column"  # projection norms: split like the heads
        tensors += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", how),
                    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", how)]
    return tuple(tensors)


def _bias_kinds(arch: Architecture) -> tuple[str, ...]:
    return ("weight", "bias") if arch.qkv_bias else ("weight",)


def expected_hf_keys(hf_config, arch: Architecture) -> set[str]:
    """Every key of the HF state dict of this model (without lm_head when tied)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not hf_config.tie_word_embeddings:
        keys.add("lm_head.weight")
    for layer in range(hf_config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        keys.update(prefix + hf_name for hf_name, _, _ in layer_tensors(arch))
        if arch.fused_checkpoint:
            keys.update(f"{prefix}self_attn.qkv_proj.{kind}" for kind in _bias_kinds(arch))
            keys.add(f"{prefix}mlp.gate_up_proj.weight")
        else:
            keys.update(f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in _bias_kinds(arch))
        if arch.experts is not None:
            keys.update(f"{prefix}mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))
            if arch.experts.shared_ffn_size:
                keys.update(f"{prefix}mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up"))
        elif not arch.fused_checkpoint:
            keys.update(f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up"))
    return keys


def check_hf_keys(hf: dict[str, torch.Tensor], hf_config, arch: Architecture) -> None:
    """Raise naming the missing and unexpected keys of an HF state dict."""
    given = set(hf) - {"lm_head.weight"} if hf_config.tie_word_embeddings else set(hf)
    expected = expected_hf_keys(hf_config, arch)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"HF state dict for {hf_config.model_type}: missing {missing[:8]}, unexpected {unexpected[:8]}")


def _split(tensor: torch.Tensor, how: str, tp: int, rank: int) -> torch.Tensor:
    if how == "replicated":
        return tensor.clone()
    dim = 0 if how == "column" else 1
    return tensor.chunk(tp, dim=dim)[rank].clone()


def _replicated_copy(parts: list[torch.Tensor]) -> torch.Tensor:
    """The one value of a replicated tensor's TP copies, which must agree."""
    for part in parts[1:]:
        if not torch.equal(part, parts[0]):
            raise ValueError("a replicated tensor differs between tensor-parallel ranks")
    return parts[0]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config) -> torch.Tensor:
    """[N*d, ...], [G*d, ...], [G*d, ...] -> megatron's per-group [G*(N/G+2)*d, ...] (weights or biases)."""
    groups, dim = hf_config.num_key_value_heads, head_dim(hf_config)
    per_group = hf_config.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * dim, *tail)
    k = k.reshape(groups, dim, *tail)
    v = v.reshape(groups, dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def unfuse_qkv(fused: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    groups, dim = hf_config.num_key_value_heads, head_dim(hf_config)
    per_group = hf_config.num_attention_heads // groups
    tail = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * dim, *tail)
    q, k, v = grouped.split([per_group * dim, dim, dim], dim=1)
    return q.reshape(-1, *tail).clone(), k.reshape(-1, *tail).clone(), v.reshape(-1, *tail).clone()


def _pad_vocab(weight: torch.Tensor, hf_config, tp: int) -> torch.Tensor:
    padded = padded_vocab_size(hf_config.vocab_size, tp)
    if weight.shape[0] != hf_config.vocab_size:
        raise ValueError(f"vocabulary matrix has {weight.shape[0]} rows, config.vocab_size is {hf_config.vocab_size}")
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], weight.shape[1])])


def _stage_layers(hf_config, pp: int, stage: int) -> range:
    per_stage = hf_config.num_hidden_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def _check_layout(hf_config, tp: int, pp: int, ep: int = 1) -> Architecture:
    """The model's architecture (`UnsupportedModel` where none covers it), after checking the split."""
    arch = architecture(hf_config)
    if ep > 1 and (arch.experts is None or arch.experts.count % ep):
        count = arch.experts.count if arch.experts else "none (a dense model)"
        raise ValueError(f"EP={ep} must divide the number of experts, {count}")
    widths = tp_split_sizes(hf_config, arch)
    if any(value % tp for value in widths.values()) or hf_config.num_hidden_layers % pp:
        raise ValueError(
            f"TP={tp} must divide {', '.join(f'{key}={value}' for key, value in widths.items())}; "
            f"PP={pp} must divide num_hidden_layers={hf_config.num_hidden_layers}"
        )
    return arch


def tp_split_sizes(hf_config, arch: Architecture) -> dict[str, int]:
    """The config's sizes that tensor parallelism splits into whole parts (the vocabulary aside)."""
    sizes = {"num_key_value_heads": hf_config.num_key_value_heads}
    if arch.experts is None:
        sizes["intermediate_size"] = hf_config.intermediate_size
    else:
        sizes["moe_intermediate_size"] = arch.experts.ffn_size
        if arch.experts.shared_ffn_size:
            sizes["shared_expert_intermediate_size"] = arch.experts.shared_ffn_size
    return sizes


def _hf_qkv(hf: dict[str, torch.Tensor], attn: str, kind: str, hf_config, arch: Architecture
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's q, k, v weights (or biases) from the HF state dict: separate, or Phi-3's [q; k; v] rows."""
    if not arch.fused_checkpoint:
        return tuple(hf[f"{attn}{p}_proj.{kind}"] for p in "qkv")
    kv_rows = hf_config.num_key_value_heads * arch.head_dim
    return hf[f"{attn}qkv_proj.{kind}"].split([hf_config.num_attention_heads * arch.head_dim, kv_rows, kv_rows])


def _hf_gate_up(hf: dict[str, torch.Tensor], mlp: str, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's gate and up weights from the HF state dict: separate, or Phi-3's [gate; up] rows."""
    if not arch.fused_checkpoint:
        return hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]
    return hf[mlp + "gate_up_proj.weight"].chunk(2)


def _fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """A gated MLP's fc1 on TP rank `tp_rank`: [its gate rows; its up rows]."""
    return torch.cat([_split(gate, "column", tp, tp_rank), _split(up, "column", tp, tp_rank)])


def _gate_up_of_fc1(full: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_fc1_shard` over the TP-gathered fc1 [tp * (gate rows + up rows), in]."""
    halves = full.unflatten(0, (tp, 2, -1))
    return halves[:, 0].flatten(0, 1), halves[:, 1].flatten(0, 1)


def _row_gathered(full: torch.Tensor, tp: int) -> torch.Tensor:
    """A row-parallel matrix's TP shards, gathered as column blocks [tp * out, in / tp], as [out, in]."""
    return full.unflatten(0, (tp, -1)).transpose(0, 1).flatten(1)


def hf_to_megatron_shard(hf: dict[str, torch.Tensor], hf_config, tp: int, pp: int, tp_rank: int, stage: int,
                         ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (stage, tensor rank[, expert-parallel rank]) from a full HF state dict."""
    arch = _check_layout(hf_config, tp, pp, ep)
    check_hf_keys(hf, hf_config, arch)
    tied = bool(hf_config.tie_word_embeddings)
    if tied and "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
        raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
    out: dict[str, torch.Tensor] = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = _split(_pad_vocab(hf["model.embed_tokens.weight"], hf_config, tp), "column", tp, tp_rank)
    for local, layer in enumerate(_stage_layers(hf_config, pp, stage)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for hf_name, mc_name, how in layer_tensors(arch):
            out[dst + mc_name] = _split(hf[src + hf_name], how, tp, tp_rank)
        for kind in _bias_kinds(arch):
            fused = fuse_qkv(*_hf_qkv(hf, src + "self_attn.", kind, hf_config, arch), hf_config)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _split(fused, "column", tp, tp_rank)
        if arch.experts is None:
            out[dst + "mlp.linear_fc1.weight"] = _fc1_shard(*_hf_gate_up(hf, src + "mlp.", arch), tp, tp_rank)
            continue
        gate_up, down = hf[src + "mlp.experts.gate_up_proj"], hf[src + "mlp.experts.down_proj"]
        local_count = arch.experts.count // ep
        for local_expert in range(local_count):
            expert = ep_rank * local_count + local_expert  # the global index (module docstring)
            fc = f"{dst}mlp.experts.local_experts.{local_expert}."
            out[fc + "linear_fc1.weight"] = _fc1_shard(*gate_up[expert].chunk(2), tp, tp_rank)
            out[fc + "linear_fc2.weight"] = _split(down[expert], "row", tp, tp_rank)
        if arch.experts.shared_ffn_size:
            shared = (hf[f"{src}mlp.shared_expert.{p}_proj.weight"] for p in ("gate", "up"))
            out[dst + "mlp.shared_experts.linear_fc1.weight"] = _fc1_shard(*shared, tp, tp_rank)
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not tied or pp > 1:
            head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
            out["output_layer.weight"] = _split(_pad_vocab(head, hf_config, tp), "column", tp, tp_rank)
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], hf_config, tp: int, pp: int, ep: int = 1) -> Shards:
    """Every (stage, tensor rank) shard of a full HF state dict; at EP > 1 every (stage, tensor rank, EP rank)."""
    if ep == 1:
        return {(s, r): hf_to_megatron_shard(hf, hf_config, tp, pp, r, s) for s in range(pp) for r in range(tp)}
    return {(s, r, q): hf_to_megatron_shard(hf, hf_config, tp, pp, r, s, ep, q)
            for s in range(pp) for r in range(tp) for q in range(ep)}


def is_expert(name: str) -> bool:
    """Whether a Megatron parameter is one of a rank's local experts (split over EP)."""
    return EXPERT_NAME.search(name) is not None


def is_replicated(name: str, arch: Architecture) -> bool:
    """Whether a Megatron parameter is the same on every TP rank: the norm weights, but OLMo's q/k
    norms over the whole projection, split like the heads."""
    if name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
        return arch.qk_norm == "head"
    return name.endswith(REPLICATED_SUFFIXES)


def hf_tensors(name: str, full: torch.Tensor, tp: int, hf_config, arch: Architecture, first_layer: int,
               expert_offset: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs of one Megatron parameter of a stage whose first layer is
    `first_layer`; `full` is its TP shards concatenated along dim 0 (a replicated one: one copy). A
    local expert's global index is its local one plus `expert_offset` (its EP rank's first expert).
    Tensors may be views of `full`. A tied model's `output_layer.weight` (the last stage's copy of
    the embedding) maps to nothing. The one place that knows the layouts in this direction:
    `megatron_to_hf` and the in-memory refit (weights.py) both go through it."""
    vocab = hf_config.vocab_size
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", full[:vocab])]
    if name == "output_layer.weight":
        return [] if hf_config.tie_word_embeddings else [("lm_head.weight", full[:vocab])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", full)]
    match = LAYER_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"no HF tensor for the Megatron parameter {name}")
    prefix, suffix = f"model.layers.{first_layer + int(match.group(1))}.", match.group(2)
    for hf_name, mc_name, how in layer_tensors(arch):
        if suffix == mc_name and how == "row":
            return [(prefix + hf_name, _row_gathered(full, tp))]
        if suffix == mc_name:
            return [(prefix + hf_name, full)]
    expert = EXPERT_NAME.fullmatch(suffix)
    if expert:
        local_index, linear = expert.groups()
        index = int(local_index) + expert_offset
        if linear == "linear_fc2":
            return [(f"{prefix}mlp.experts.down_proj{EXPERT_SLICE}{index}", _row_gathered(full, tp))]
        return [(f"{prefix}mlp.experts.gate_up_proj{EXPERT_SLICE}{index}", torch.cat(_gate_up_of_fc1(full, tp)))]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        gate, up = _gate_up_of_fc1(full, tp)
        return [(f"{prefix}mlp.shared_expert.gate_proj.weight", gate), (f"{prefix}mlp.shared_expert.up_proj.weight", up)]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = unfuse_qkv(full, hf_config)
        if arch.fused_checkpoint:
            return [(f"{prefix}self_attn.qkv_proj.{kind}", torch.cat([q, k, v]))]
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":  # per TP rank: [gate rows of the rank; up rows of the rank]
        gate, up = _gate_up_of_fc1(full, tp)
        if arch.fused_checkpoint:
            return [(f"{prefix}mlp.gate_up_proj.weight", torch.cat([gate, up]))]
        return [(f"{prefix}mlp.gate_proj.weight", gate), (f"{prefix}mlp.up_proj.weight", up)]
    raise ValueError(f"no HF tensor for the Megatron parameter {name}")


def megatron_to_hf(shards: Shards, hf_config, tp: int, pp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    """The full HF state dict from every (stage, tensor rank) shard; at EP > 1 from every (stage,
    tensor rank, EP rank) shard: each EP rank's local experts, the other tensors from EP rank 0."""
    arch = _check_layout(hf_config, tp, pp, ep)
    expected = ({(s, r) for s in range(pp) for r in range(tp)} if ep == 1 else
                {(s, r, q) for s in range(pp) for r in range(tp) for q in range(ep)})
    if set(shards) != expected:
        raise ValueError(f"expected shards for every (stage, rank{', EP rank' if ep > 1 else ''}) of PP={pp} x TP={tp}"
                         f"{f' x EP={ep}' if ep > 1 else ''}, got {sorted(shards)}")

    def shard(stage: int, rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
        return shards[(stage, rank)] if ep == 1 else shards[(stage, rank, ep_rank)]

    local_count = arch.experts.count // ep if arch.experts else 0
    hf: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        first = _stage_layers(hf_config, pp, stage).start
        for name in shard(stage, 0, 0):
            for ep_rank in range(ep if is_expert(name) else 1):
                parts = [shard(stage, r, ep_rank)[name] for r in range(tp)]
                full = _replicated_copy(parts) if is_replicated(name, arch) else torch.cat(parts)
                hf.update((key, value.clone()) for key, value in
                          hf_tensors(name, full, tp, hf_config, arch, first, ep_rank * local_count))
    hf = stack_expert_slices(hf)
    check_hf_keys(hf, hf_config, arch)
    return hf


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint file's state with its per-expert matrices (`...mlp.experts.<e>.gate_proj.weight`,
    `up_proj`, `down_proj`: how released checkpoints hold them and transformers saves them) as the
    stacked tensors of the loaded model, which the functions here take (`gate_up_proj` [E, 2I, H]:
    gate rows then up; `down_proj` [E, H, I]). Concatenation only; `per_expert` inverts it."""
    out, experts = {}, {}
    for name, value in state.items():
        match = CHECKPOINT_EXPERT.fullmatch(name)
        if match is None:
            out[name] = value
        else:
            prefix, expert, kind = match.groups()
            experts.setdefault(prefix, {}).setdefault(int(expert), {})[kind] = value
    for prefix, by_expert in experts.items():
        order = range(len(by_expert))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `stacked_experts`: the state as a checkpoint file holds it."""
    out = {}
    for name, value in state.items():
        stacked = STACKED_EXPERTS.fullmatch(name)
        if stacked is None:
            out[name] = value
            continue
        prefix, kind = stacked.groups()
        for expert, matrix in enumerate(value):
            if kind == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = matrix
            else:
                gate, up = matrix.chunk(2)
                out[f"{prefix}.{expert}.gate_proj.weight"], out[f"{prefix}.{expert}.up_proj.weight"] = gate, up
    return out


def split_expert_slice(name: str) -> tuple[str, int | None]:
    """("<HF name>", expert) of an expert slice's name (`EXPERT_SLICE`); (name, None) for any other."""
    base, _, expert = name.partition(EXPERT_SLICE)
    return base, int(expert) if expert else None


def stack_expert_slices(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`hf` with each stacked expert tensor assembled from its slices, in expert order."""
    out, slices = {}, {}
    for name, value in hf.items():
        base, expert = split_expert_slice(name)
        if expert is None:
            out[name] = value
        else:
            slices.setdefault(base, {})[expert] = value
    for base, by_expert in slices.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{base}: experts {sorted(by_expert)} are not 0 .. {len(by_expert) - 1}")
        out[base] = torch.stack([by_expert[expert] for expert in range(len(by_expert))])
    return out


def load_shard(model: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy a shard into this rank's GPTModel; its parameter names must match the shard's keys exactly."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
    if missing or unexpected:
        raise ValueError(f"megatron shard does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != shard[name].shape:
                raise ValueError(f"{name}: model shape {tuple(param.shape)}, shard shape {tuple(shard[name].shape)}")
            param.copy_(shard[name])
