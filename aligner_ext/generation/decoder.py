"""A decoder-only transformer run step by step over an external KV cache, on the policy's own weights.

`Decoder` holds the prefill and decode steps over a model's layer weights (`LayerWeights`); its
subclasses say where the weights come from: `HFDecoder` (here) an HF module's,
`models/megatron/decoder.MegatronDecoder` a Megatron GPTModel's tensor-parallel shards (with the
sums over the ranks between the layer functions).

It runs every family `aligner_ext/architecture.py` describes (Llama, Mistral, Ministral, Qwen2,
Qwen3, Phi-3, OLMo 2 / 3, SmolLM3, Gemma 3 text; the mixtures of experts Qwen3-MoE and Qwen2-MoE,
on the Megatron backend under expert parallelism too, `ExpertExchange`), composed of that module's
pieces: the family's RMSNorm formula and norm placement (`LayerWeights`' norms by role), per-head or
whole-projection q/k norms, SwiGLU or GeGLU or a mixture of SwiGLU experts, Gemma's embedding scale and attention scale, and per layer a RoPE
table (every scaling type, partial rotary) or none, and a sliding window or none. `HFDecoder`
computes such a causal LM with these functions over the policy's parameter tensors (referenced,
never copied: after an optimizer step it computes with the new values); the math is the
transformers modules', op for op, which the CPU tests check token for token against the HF engine
for every family. Only the attention and the cache differ:

    SlotKVCache   one K and one V tensor per layer, [slots, kv_heads, length, head_dim]: a sequence
                  owns one slot for its whole life and its token t sits at position t (windowed
                  layers too: their cache keeps every position, and attention reads their window)
    prefill       new sequences, right-padded to the longest: causal attention over their own
                  tokens (within each layer's window), K/V written to positions [0, length) of
                  their slots
    decode        one new token for slots [0, rows): its K/V written at its position, attention over
                  the first `attended` positions of the slot, masked after its own position and
                  before its layer's window

Per step, cos and sin are computed once per RoPE table (Gemma 3 and OLMo 3 have one for local and
one for global layers) and each layer takes its own, or none; attention masks once per distinct
window.

With `fuse_projections`, each layer's q, k, v weights (and biases) are moved into one buffer and
the parameters re-pointed to its rows (`Parameter.data` becomes a view: the same Parameter objects,
so the optimizer, gradients and checkpoints see no difference), likewise gate and up: a decode step
then runs 4 matrix products per layer instead of 7, still without a copy of the weights (Phi-3's
checkpoint has them fused already). Anything that later replaces a parameter's storage (`model.to`,
a load that assigns) is noticed by `refresh` (called before every generate call), which fuses that
layer again.

A decode layer is two functions of tensors (`decode_inputs_written`: the residual add left by the
layer before, norms, projections, q/k norms, rotary embedding and the K/V cache write;
`layer_output_parts`) with the attention between them, so `compile=True` hands the two to
torch.compile once for all layers (every layer passes tensors of the same shapes; only the rows and
the cache's slots and length are dynamic, `compile_varying`; a layer without RoPE is a second
graph) and the decode step, captured in a CUDA graph by the engine, runs fused kernels. Under
tensor parallelism the sums over the ranks split them further: after the attention's and the MLP's
output projections, and, for OLMo's q/k norms over the whole projection, between the projections
and the norms (`decode_projections`, the sums of squares summed, `decode_written`). A post-MLP norm
(OLMo, Gemma 3) is applied where the MLP's output joins the residual stream, in the next layer's
first function or before the head, since under tensor parallelism it needs the summed output.
(Compiling the attention into the same graph, or every layer into one, was measured slower or
compiled for minutes: docs/benchmarks.md.)

A mixture of experts' MLP (`experts_mlp`) routes as transformers' router does, op for op (the
trainer's forward takes the same experts), and computes the chosen experts' gated MLPs from the
stacked expert tensors transformers keeps [E, 2I, h] and [E, h, I] (on the Megatron backend its
experts' TP shards stacked alike, `models/megatron/decoder.py`): in bfloat16 by two
`torch._grouped_mm` products over all experts, the (token, expert) pairs sorted by expert, as
transformers' `grouped_mm` experts do (so the decode step stays one CUDA graph: no host sync, no shape
that depends on the routing); in other dtypes, which `_grouped_mm` takes neither under torch.compile
nor on a GPU without a host sync (float32), nor at all (float64), by a gather of each pair's expert
weights (`grouped_mm_runs`). A cache made with `record_routing` holds a `RoutingRecord`: the prefill
and the decode step keep the experts each token took per layer at its slot and position, for the
trainer (models/moe.py); `experts_mlp` writes a decode step's into a static buffer per layer, so the
step stays one CUDA graph. Under expert parallelism (the Megatron backend's
policy.expert_model_parallel_size) each rank holds only its experts: `ExpertExchange` trades the
MLP's tokens over the expert-parallel group, and the engine keeps the group's ranks in lockstep
(rollout.py).

Low-rank adapters (LoRA, `aligner_ext/adapters.py`) run from the policy's own A and B tensors inside
the same functions: each adapted product is `x W^T + (x A^T) B^T * alpha / r` (`Projection.adapters`,
`LayerWeights.o_adapter`, `down_adapter`), op for op as the policy's LoRA layers, so nothing is merged into the
frozen base and no second copy of it exists; on a fused projection the base product stays one and
each output adds its own adapter's term.

Attention goes through `attend_prefill` and one of DECODE_ATTENTION, the one place to swap kernels:
`attention="sdpa"` (torch SDPA: cuDNN or flash on a GPU, under an additive mask), `"flex"`
(FlexAttention, compiled with the layer functions' settings) or `"triton"` (our flash-decoding
kernel, decode_attention.py, which reads each sequence's cache up to its own position, and from its
window's first position); `"auto"` is triton on a GPU and sdpa on the CPU. The engine calls only
`new_cache`, `prefill`, `decode` and `refresh`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from aligner_ext.adapters import LowRank, adapter_of, add_low_rank, is_adapted, linear
from aligner_ext.architecture import (
    Architecture, activation, apply_rotary, architecture, rms_norm, rope_tables, rotary_cos_sin,
    scale_embedding,
)
from aligner_ext.generation import decode_attention
from aligner_ext.generation.decode_attention import attend_decode_triton
from aligner_ext.generation.settings import ATTENTION_CHOICES


class RoutingRecord:
    """The experts a mixture of experts' routers chose for each token a call feeds through it:
    `history` [slots, length, layers, k] at the tokens' slots and positions, as the K/V cache holds
    their keys (uint8 where the expert indices fit in it, else int16); and one `step` buffer [slots, k]
    per layer, which `experts_mlp` fills in place during a decode step (static addresses a CUDA graph
    holds, no host sync) and `write_step` moves into the history in one indexed write per step."""

    def __init__(self, num_layers: int, slots: int, length: int, top_k: int, experts: int, device: torch.device):
        dtype = routing_dtype(experts)
        self.history = torch.zeros((slots, length, num_layers, top_k), dtype=dtype, device=device)
        self.step = [torch.zeros((slots, top_k), dtype=dtype, device=device) for _ in range(num_layers)]
        for buffer in self.step:  # a call's slot count varies: no recompilation of the decode step for it
            torch._dynamo.maybe_mark_dynamic(buffer, 0)

    @staticmethod
    def bytes_per_slot_token(num_layers: int, top_k: int, experts: int) -> int:
        return num_layers * top_k * routing_dtype(experts).itemsize

    def write_step(self, positions: torch.Tensor) -> None:
        """Slots [0, rows) took the step buffers' experts for their tokens at `positions` [rows]."""
        rows = len(positions)
        chosen = torch.stack([buffer[:rows] for buffer in self.step], dim=1)  # [rows, layers, k]
        self.history[torch.arange(rows, device=positions.device), positions] = chosen


def routing_dtype(experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert index."""
    return torch.uint8 if experts <= 256 else torch.int16


class SlotKVCache:
    """Per-layer K/V tensors [slots, kv_heads, length, head_dim], allocated once per generate call; with
    `routing`, the experts a mixture of experts chose for each token at the same slots and positions."""

    def __init__(self, num_layers: int, slots: int, length: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, routing: RoutingRecord | None = None):
        shape = (slots, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = length
        self.routing = routing

    @staticmethod
    def bytes_per_slot_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def copy_from(self, other: "SlotKVCache", sources: list[int], targets: list[int], length: int) -> None:
        """Give slots `targets` the first `length` positions of `other`'s slots `sources` (`other` may be
        this cache: a shared prompt's rows; or a kept cache: prefixes, where positions past a shorter
        prefix are overwritten by its own tokens before they are read)."""
        device = self.keys[0].device
        sources, targets = torch.tensor(sources, device=device), torch.tensor(targets, device=device)
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[targets, :, :length] = theirs[sources, :, :length]
        if self.routing is not None and other.routing is not None:  # the tokens' experts go with their K/V
            self.routing.history[targets, :length] = other.routing.history[sources, :length]


class Projection(NamedTuple):
    """Products whose outputs are used side by side: one fused weight (and bias) split into `sizes`
    output columns, or one weight per output (bias entries None where the model has none); with LoRA,
    one adapter per output (None where that output has none), or none at all (empty)."""

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    sizes: tuple[int, ...]
    adapters: tuple[LowRank | None, ...] = ()


def project(x: torch.Tensor, projection: Projection) -> tuple[torch.Tensor, ...]:
    """The outputs of `projection` for `x`, one per original product, each with its adapter's term."""
    if len(projection.weights) == 1:
        outputs = F.linear(x, projection.weights[0], projection.biases[0]).split(projection.sizes, dim=-1)
    else:
        outputs = tuple(F.linear(x, w, b) for w, b in zip(projection.weights, projection.biases))
    if not projection.adapters:
        return outputs
    return tuple(out if adapter is None else add_low_rank(out, x, adapter)
                 for out, adapter in zip(outputs, projection.adapters))


def split_adapter(adapter: LowRank | None, sizes: tuple[int, ...]) -> tuple[LowRank | None, ...]:
    """An adapter of a fused product as one per output: B's rows split (views), A shared."""
    if adapter is None:
        return (None,) * len(sizes)
    return tuple(LowRank(adapter.a, b, adapter.scale) for b in adapter.b.split(sizes))


class ExpertWeights(NamedTuple):
    """A mixture of experts' tensors (`architecture.Experts`), stacked as transformers keeps them: the
    router [E, h], every expert's gate rows then up rows [E, 2I, h] and its down projection [E, h, I];
    how many experts each token takes and whether their weights are renormalised to sum to 1. Qwen2-MoE's
    shared expert: its gate/up `Projection`, down [h, I] (with LoRA, its adapter) and its gate [1, h],
    whose sigmoid scales its output; None elsewhere. `record` [at least tokens, k]: where a call that
    records routing (`RoutingRecord`) has `experts_mlp` write each token's chosen experts; None elsewhere."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    normalize_top_k: bool
    shared_gate_up: Projection | None = None
    shared_down: torch.Tensor | None = None
    shared_down_adapter: LowRank | None = None
    shared_gate: torch.Tensor | None = None
    record: torch.Tensor | None = None


class LayerWeights(NamedTuple):
    """One decoder layer's parameter tensors (the module's own, or fused buffers its parameters
    view; None where the model has none). Norms by role (`Architecture.norm_names`): a pre-norm layer
    has `input_norm` and `pre_mlp_norm`; OLMo's post-norm layers the norms of the attention's and the
    MLP's outputs, applied before each residual add; Gemma 3's all four. A mixture of experts' layer
    has `experts` and no dense MLP (`gate_up` and `down` None)."""

    input_norm: torch.Tensor | None
    qkv: Projection
    q_norm: torch.Tensor | None  # per head [d], or over the projection [H * d] (`Shape.qk_norm`)
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_norm: torch.Tensor | None
    pre_mlp_norm: torch.Tensor | None
    gate_up: Projection | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None
    o_adapter: LowRank | None = None  # LoRA of the attention's output projection
    down_adapter: LowRank | None = None  # of the MLP's down projection
    experts: ExpertWeights | None = None


def fused_buffer(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor over `params` stacked along dim 0 when they lie back to back in one storage (as
    `fuse_rows` leaves them), else None."""
    first = params[0]
    offset = first.storage_offset()
    for param in params:
        if (param.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or param.dtype != first.dtype
                or not param.is_contiguous() or param.shape[1:] != first.shape[1:] or param.storage_offset() != offset):
            return None
        offset += param.numel()
    rows = sum(param.shape[0] for param in params)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


@torch.no_grad()
def fuse_rows(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """`params` stacked along dim 0 in one buffer, each parameter re-pointed to its rows (the same
    Parameter objects, now views of the buffer: trained and saved as before). Already fused: the
    buffer they view, nothing copied."""
    buffer = fused_buffer(params)
    if buffer is not None:
        return buffer
    with torch.inference_mode(False):  # the buffer is trained through its views
        buffer = torch.cat([param.detach() for param in params])
    offset = 0
    for param in params:
        param.data = buffer[offset : offset + param.shape[0]]
        offset += param.shape[0]
    return buffer


class Shape(NamedTuple):
    """The constants a layer's functions need (head counts of this rank's shard under tensor
    parallelism) and the family's static choices (`aligner_ext/architecture.py`), plain values so that
    torch.compile specialises on them."""

    num_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    norm: str = "llama"  # RMSNorm formula: llama | float32_scale | gemma
    activation: str = "silu"  # the gated MLP's: silu | gelu_tanh
    qk_norm: str | None = None  # None | head | projection
    tensor_parallel: int = 1  # ranks the heads are split over: a projection q/k norm averages over all of them
    qkv_per_group: bool = False  # the fused q/k/v output is laid out per K/V group (Megatron), not q then k then v


def split_qkv(x: torch.Tensor, projection: Projection, shape: Shape) -> tuple[torch.Tensor, ...]:
    """q, k, v of `x` [b, s, h], each [b, s, heads, d]. Megatron's fused layout holds, for each K/V
    group g, the rows of its query heads, then k_g, then v_g: query head g * (H / KVH) + j uses K/V
    head g, as transformers' repeat_kv has it."""
    batch, width, _ = x.shape
    if not shape.qkv_per_group:
        q, k, v = project(x, projection)
        return (q.reshape(batch, width, shape.num_heads, shape.head_dim),
                k.reshape(batch, width, shape.kv_heads, shape.head_dim),
                v.reshape(batch, width, shape.kv_heads, shape.head_dim))
    per_group = shape.num_heads // shape.kv_heads
    grouped = linear(x, projection.weights[0], projection.biases[0],
                     projection.adapters[0] if projection.adapters else None)  # the adapter of the whole product
    grouped = grouped.reshape(batch, width, shape.kv_heads, per_group + 2, shape.head_dim)
    q = grouped[:, :, :, :per_group].reshape(batch, width, shape.num_heads, shape.head_dim)
    return q, grouped[:, :, :, per_group], grouped[:, :, :, per_group + 1]


def norm(x: torch.Tensor, weight: torch.Tensor | None, shape: Shape) -> torch.Tensor:
    """The family's RMSNorm of x, or x where the layer has no norm in that role."""
    return x if weight is None else rms_norm(x, weight, shape.eps, shape.norm)


def projections(hidden: torch.Tensor, w: LayerWeights, shape: Shape):
    """q, k, v [b, s, heads, d] of the layer input `hidden` [b, s, h] (input norm, products, per-head
    q/k norms) and, for q/k norms over the whole projection (OLMo), the sums of squares of q and of k
    over this rank's heads [b, s, 2] (None otherwise): under tensor parallelism they are summed over
    the ranks before `positioned` normalises with them."""
    q, k, v = split_qkv(norm(hidden, w.input_norm, shape), w.qkv, shape)
    if shape.qk_norm == "head":
        return norm(q, w.q_norm, shape), norm(k, w.k_norm, shape), v, None
    squares = None
    if shape.qk_norm == "projection":
        squares = torch.stack([q.float().pow(2).sum((-2, -1)), k.float().pow(2).sum((-2, -1))], dim=-1)
    return q, k, v, squares


def positioned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, squares: torch.Tensor | None, w: LayerWeights,
               cos: torch.Tensor | None, sin: torch.Tensor | None,
               shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, H, s, d], k and v [b, KVH, s, d]: `projections`' outputs normalised over the whole
    projection where `squares` (summed over the ranks) is given, then rotated to their positions
    (cos, sin [b, s, rotary_dim]; None: a layer without RoPE)."""
    if squares is not None:
        batch, width = q.shape[:2]
        per_head = shape.tensor_parallel * shape.head_dim  # a projection's width is this times this rank's heads
        q = rms_norm(q.reshape(batch, width, -1), w.q_norm, shape.eps, shape.norm,
                     squares[..., :1] / (per_head * shape.num_heads)).view(q.shape)
        k = rms_norm(k.reshape(batch, width, -1), w.k_norm, shape.eps, shape.norm,
                     squares[..., 1:] / (per_head * shape.kv_heads)).view(k.shape)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cos is not None:
        cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q, k, v


def out_projection(attended: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """The attention output [b, H, s, d] projected back to [b, s, h] (under tensor parallelism this
    rank's partial sum)."""
    batch, _, width, _ = attended.shape
    return linear(attended.transpose(1, 2).reshape(batch, width, -1), w.o, w.o_bias, w.o_adapter)


def residual_mlp(hidden: torch.Tensor, projected: torch.Tensor, w: LayerWeights, shape: Shape,
                 exchange: "ExpertExchange | None" = None,
                 tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden state after attention (`hidden` plus the projected attention output, normalised
    where the layer has a post-attention norm) and the MLP's output of it (under tensor parallelism
    this rank's partial sum). The post-MLP norm is left to whoever adds that output to the hidden
    state (`decode_projections`, `Decoder.prefill`, the head): under tensor parallelism it needs the
    sum over the ranks first. `exchange`, `tokens`: a mixture of experts' under expert parallelism
    (`experts_mlp`)."""
    hidden = hidden + norm(projected, w.post_attention_norm, shape)
    if w.experts is not None:
        return hidden, experts_mlp(norm(hidden, w.pre_mlp_norm, shape), w.experts, shape, exchange, tokens)
    gate, up = project(norm(hidden, w.pre_mlp_norm, shape), w.gate_up)
    return hidden, linear(activation(shape.activation)(gate) * up, w.down, w.down_bias, w.down_adapter)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int,
          normalize_top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each token of `x` [n, h] takes [n, k] and their weights [n, k], op for op as
    transformers' routers (Qwen3MoeTopKRouter, Qwen2MoeTopKRouter): logits in the model's dtype,
    softmax in float32, the top k (renormalised where the model says so), cast back. The trainer's
    forward takes the same experts, so the engine samples from the model it trains."""
    logits = F.linear(x, router)
    top, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if normalize_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), chosen


def grouped_mm_runs(x: torch.Tensor, experts: ExpertWeights) -> bool:
    """Whether `torch._grouped_mm` computes the experts' products: bfloat16 (its only dtype under
    torch.compile, and on a GPU its only dtype without a host sync, which a CUDA graph cannot hold;
    it rejects float64 everywhere) with rows a multiple of 16 bytes (its stride rule)."""
    return x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and experts.down.shape[-1] % 8 == 0


def grouped_expert_outputs(x: torch.Tensor, chosen: torch.Tensor, experts: ExpertWeights,
                           act: Callable) -> torch.Tensor:
    """Each token's chosen experts' outputs [n, k, h] by two grouped products over all experts, as
    transformers' `grouped_mm_experts_forward`: the (token, expert) pairs sorted by expert, the counts
    by histc (bincount would sync with the host, which a CUDA graph cannot hold), their int32 cumulative
    sums the groups' ends; nothing shaped by the routing, so the step stays capturable."""
    tokens, top_k = chosen.shape
    count = experts.gate_up.shape[0]
    expert_of_pair, pair = torch.sort(chosen.flatten())
    # histc counts floats only on the CPU, and under deterministic algorithms integers only on a GPU
    counts = torch.histc(expert_of_pair.float() if x.device.type == "cpu" else expert_of_pair.int(),
                         bins=count, min=0, max=count - 1)
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x[pair // top_k], experts.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    outputs = torch._grouped_mm(act(gate) * up, experts.down.transpose(1, 2), offs=ends)
    return torch.empty_like(outputs).index_copy_(0, pair, outputs).view(tokens, top_k, -1)


def gathered_expert_outputs(x: torch.Tensor, chosen: torch.Tensor, experts: ExpertWeights,
                            act: Callable) -> torch.Tensor:
    """`grouped_expert_outputs` where `torch._grouped_mm` does not run (`grouped_mm_runs`: float32,
    float64): each pair's expert weights gathered and multiplied in a batch, [n, k, 2I, h] of weights
    at once, so for the CPU tests and small float32 models, not for a large model's prefill."""
    gate, up = (experts.gate_up[chosen] @ x[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)
    return (experts.down[chosen] @ (act(gate) * up)[..., None]).squeeze(-1)


def experts_mlp(x: torch.Tensor, experts: ExpertWeights, shape: Shape, exchange: "ExpertExchange | None" = None,
                tokens: int | None = None) -> torch.Tensor:
    """A mixture of experts' output for `x` [b, s, h], as transformers' sparse MoE blocks compute it:
    `route`, each chosen expert's gated MLP, their outputs summed with the routing weights, plus
    Qwen2-MoE's shared expert times sigmoid of its gate. The products are batched over the experts,
    never a loop over experts or tokens (`grouped_mm_runs` says which kernel). Under expert
    parallelism `exchange` computes the routed sum over the ranks' experts (`tokens`: the rows each
    rank of its group sends, this call's padded to them)."""
    flat = x.reshape(-1, x.shape[-1])
    act = activation(shape.activation)
    weights, chosen = route(flat, experts.router, experts.top_k, experts.normalize_top_k)
    if experts.record is not None:
        experts.record[: len(chosen)].copy_(chosen)
    if exchange is None:
        out = weighted_expert_sum(flat, weights, chosen, experts, act)
    else:
        out = exchange(flat, weights, chosen, experts, act, tokens)
    if experts.shared_gate is not None:
        gate, up = project(flat, experts.shared_gate_up)
        shared = linear(act(gate) * up, experts.shared_down, None, experts.shared_down_adapter)
        out = out + torch.sigmoid(F.linear(flat, experts.shared_gate)) * shared
    return out.view(x.shape)


def weighted_expert_sum(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: ExpertWeights,
                        act: Callable, first: int | None = None) -> torch.Tensor:
    """The chosen experts' outputs for `x` [n, h] summed with the routing `weights` [n, k]. Under expert
    parallelism (`first` given) `experts` holds the experts [first, first + its count) of the global
    ones `chosen` names, and the pairs routed elsewhere add nothing: the grouped products skip them
    (their expert set to the count: sorted past the last group's end, out of histc's range, as
    transformers' expert-parallel sentinels), the gather computes them with expert 0; either way
    their outputs are dropped, not scaled by 0 (the grouped product leaves their rows uninitialised)."""
    grouped = grouped_mm_runs(x, experts)
    product = grouped_expert_outputs if grouped else gathered_expert_outputs
    if first is None:
        return (product(x, chosen, experts, act) * weights[..., None]).sum(dim=1)
    count = experts.gate_up.shape[0]
    local = chosen - first
    outside = (local < 0) | (local >= count)
    outputs = product(x, local.masked_fill(outside, count if grouped else 0), experts, act)
    return (outputs.masked_fill(outside[..., None], 0.0) * weights[..., None]).sum(dim=1)


class ExpertExchange:
    """Expert parallelism in the engine, as megatron-core's all-gather token dispatcher: each rank of
    `group` holds `experts / size` consecutive experts (global index = rank * local + local index) and
    decodes its own tokens. Per MoE layer each rank routes its tokens (and records their experts),
    the group all-gathers the tokens' hidden states, routing weights and experts, each rank computes
    its experts' weighted outputs for every gathered token (pairs routed elsewhere skipped), and a
    reduce-scatter sums them back to the tokens' own ranks. Under tensor parallelism the group is one
    TP rank's (megatron-core's expert-model-parallel group): the ranks of a TP group decode the same
    tokens, each exchange sums its columns' partial outputs, and the MLP's sum over TP adds them up.

    The collectives need the same rows on every rank and the same number of MoE passes: a decode step
    runs the rows the group agreed on, a prefill pads its tokens to the group's most (padded rows take
    no expert), and a rank without work joins with `idle` passes (the engine's lockstep, rollout.py).
    `agree` runs over `host_group` (gloo, CPU tensors), so it never waits for the device: the decode
    step's collectives over `group` (NCCL on a GPU) are captured in its CUDA graph, the agreements
    stay outside it."""

    def __init__(self, group, host_group, experts: int):
        self.group, self.host_group = group, host_group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = experts // self.size
        self.first = self.rank * self.local  # the global index of this rank's first expert

    def agree(self, values: list[int]) -> list[int]:
        """Each value's maximum over the group (host integers)."""
        tensor = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        return tensor.tolist()

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: ExpertWeights,
                 act: Callable, tokens: int | None = None) -> torch.Tensor:
        """The routed experts' weighted sum [n, h] for this rank's tokens `x` [n, h] (routed to the
        global experts `chosen` [n, k] with `weights`), each rank sending `tokens` rows (default n)."""
        rows, hidden = x.shape
        pad = (tokens or rows) - rows
        sent = F.pad(torch.cat([x, weights], dim=-1), (0, 0, 0, pad))
        ids = F.pad(chosen, (0, 0, 0, pad), value=-1)  # padded rows: no rank's expert
        gathered = sent.new_empty(self.size * len(sent), sent.shape[-1])
        gathered_ids = ids.new_empty(self.size * len(ids), ids.shape[-1])
        dist.all_gather_into_tensor(gathered, sent, group=self.group)
        dist.all_gather_into_tensor(gathered_ids, ids, group=self.group)
        summed = weighted_expert_sum(gathered[:, :hidden], gathered[:, hidden:], gathered_ids, experts, act,
                                     self.first)
        out = summed.new_empty(len(sent), hidden)
        dist.reduce_scatter_tensor(out, summed, group=self.group)
        return out[:rows]

    def idle(self, layers: list[LayerWeights], shape: Shape, tokens: int) -> None:
        """A pass through every MoE layer for a rank with no tokens of its own: its experts compute
        the others' tokens (`tokens` rows from each rank)."""
        act = activation(shape.activation)
        for w in layers:
            if w.experts is not None:
                router = w.experts.router
                ids = torch.empty(0, w.experts.top_k, dtype=torch.long, device=router.device)
                self(router.new_empty(0, router.shape[1]), router.new_empty(0, w.experts.top_k), ids, w.experts, act,
                     tokens)


def recording(w: LayerWeights, record: torch.Tensor) -> LayerWeights:
    """A mixture of experts' layer whose `experts_mlp` writes each token's chosen experts into `record`."""
    return w._replace(experts=w.experts._replace(record=record))


def layer_output_parts(hidden: torch.Tensor, attended: torch.Tensor, w: LayerWeights,
                       shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output from its input `hidden` [b, s, h] and the attention output [b, H, s, d], as
    two terms to add: the hidden state after attention and the MLP's output (a decode step leaves the
    sum to the next layer's first kernel, which fuses it with the norms)."""
    return residual_mlp(hidden, out_projection(attended, w), w, shape)


def visible(positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[*positions.shape, length] bool: whether a query at each position sees each cache position
    (transformers' semantics: j <= i, and i - window < j under a sliding window)."""
    cache = torch.arange(length, device=positions.device)
    seen = cache <= positions[..., None]
    if window is not None:
        seen &= cache > positions[..., None] - window
    return seen


def attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [b, H, s, d] over k, v [b, KVH, t, d] where `mask` [b, 1, s, t] is True."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """One query per sequence, q [b, H, 1, d], over keys, values [b, KVH, t, d] with the additive
    mask `bias` [b, t] (0 where visible, -inf elsewhere; it holds the layer's `window`). The H / KVH
    query heads sharing a K/V head become that head's query rows, so the kernel reads each K/V head
    once and nothing is expanded (head h uses K/V head h // (H / KVH), as transformers' repeat_kv)."""
    batch, heads, _, dim = q.shape
    grouped = q.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, 1, dim)


def attend_decode_flex(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                       scale: float, window: int | None = None) -> torch.Tensor:
    """`attend_decode` by FlexAttention: the additive mask enters as a score modification, the
    query heads of a K/V head share its reads (`enable_gqa`)."""

    def add_bias(score, batch, head, query, key):
        return score + bias[batch, key]

    return flex_attention(q, keys, values, score_mod=add_bias, scale=scale, enable_gqa=keys.shape[1] != q.shape[1])


def compile_varying(fn: Callable, varying: dict[int, tuple[int, ...]]) -> Callable:
    """torch.compile of `fn` with static shapes except the dimensions `varying` names (argument index ->
    dims): the rows of a decode step and a call's cache slots and length. Weights and head sizes stay
    static, so one compilation serves every call, with no recompilation (on the CPU it compiled in
    half the time that fully dynamic shapes took; docs/benchmarks.md)."""
    compiled = torch.compile(fn, dynamic=False)

    def call(*args):
        for index, dims in varying.items():
            if args[index] is not None:  # a layer without RoPE passes no tables
                for dim in dims:
                    torch._dynamo.maybe_mark_dynamic(args[index], dim)
        return compiled(*args)

    return call


def additive_mask(positions: torch.Tensor, attended: int, dtype: torch.dtype,
                  window: int | None = None) -> torch.Tensor:
    """[b, attended]: 0 where a row sees a cache position (`visible`), -inf elsewhere (one mask per
    distinct window for every layer: a boolean one is converted by SDPA in each call)."""
    seen = visible(positions, attended, window)
    return torch.zeros(seen.shape, dtype=dtype, device=positions.device).masked_fill_(~seen, float("-inf"))


class DecodeAttention(NamedTuple):
    """A decode attention kernel: `attend(q, keys, values, mask, scale, window)` with the `mask` that
    `mask_of(positions, attended, dtype, window)` builds once per step and distinct sliding window
    (`window`: the layer's, or None; the masks of sdpa and flex hold it, the Triton kernel bounds its
    reads by it); `compiled` says whether torch.compile runs it on a GPU (with the layer functions'
    settings); `reads_to_position` that it reads each sequence's cache only up to its position, so
    the engine passes the whole cache (one CUDA graph per batch size) instead of the positions up to
    the longest sequence's."""

    mask_of: Callable
    attend: Callable
    compiled: bool
    reads_to_position: bool = False


def _positions_only(positions: torch.Tensor, attended: int, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    return positions


def _attend_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
                   window: int | None) -> torch.Tensor:
    return attend_decode_triton(q, keys, values, positions, scale, window=window)


DECODE_ATTENTION = {
    "sdpa": DecodeAttention(additive_mask, attend_decode, False),
    "flex": DecodeAttention(additive_mask, attend_decode_flex, True),  # eager FlexAttention is a slow reference
    "triton": DecodeAttention(_positions_only, _attend_triton, False, True),
}


def resolve_attention(attention: str, device: torch.device) -> str:
    """`auto`: the Triton kernel on a GPU (1.4-2.5x cuDNN's SDPA, docs/benchmarks.md), SDPA elsewhere."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"decode attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
    if attention == "auto":
        return "triton" if device.type == "cuda" and decode_attention.available() else "sdpa"
    if attention == "triton" and not decode_attention.available():
        raise ValueError("decode attention triton needs the triton package (it comes with torch's CUDA builds)")
    return attention


def decode_projections(hidden: torch.Tensor, mlp: torch.Tensor, mlp_norm: torch.Tensor | None, w: LayerWeights,
                       shape: Shape):
    """The layer input `hidden + mlp` (the previous layer's two output terms, `layer_output_parts`, its
    MLP output through its post-MLP norm `mlp_norm` where it has one) of one token per row [b, 1, h],
    and `projections` of it."""
    hidden = hidden + norm(mlp, mlp_norm, shape)
    return hidden, *projections(hidden, w, shape)


def decode_written(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, squares: torch.Tensor | None, w: LayerWeights,
                   cos: torch.Tensor | None, sin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                   positions: torch.Tensor, shape: Shape) -> torch.Tensor:
    """The query [b, H, 1, d] of `decode_projections`' outputs at `positions` [b] (`positioned`), its
    K/V written into the layer's cache (`keys`, `values` [slots, KVH, length, d]) at those positions,
    rows [0, b) being slots [0, b). The cache is indexed directly (a write through a view of it makes
    the compiled graph copy the whole cache)."""
    q, k, v = positioned(q, k, v, squares, w, cos, sin, shape)
    slots = torch.arange(len(positions), device=positions.device)
    keys[slots, :, positions] = k[:, :, 0]
    values[slots, :, positions] = v[:, :, 0]
    return q


def decode_inputs_written(hidden: torch.Tensor, mlp: torch.Tensor, mlp_norm: torch.Tensor | None, w: LayerWeights,
                          cos: torch.Tensor | None, sin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                          positions: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_projections` then `decode_written` in one function, so that torch.compile fuses the
    residual add with the norms and the rotary embedding with the cache write; the layer input and
    the query."""
    hidden, q, k, v, squares = decode_projections(hidden, mlp, mlp_norm, w, shape)
    return hidden, decode_written(q, k, v, squares, w, cos, sin, keys, values, positions, shape)


class Decoder:
    """Prefill and decode steps over a `SlotKVCache` for a model whose layers are `LayerWeights`
    (module docstring). A subclass supplies the weights (`layers`, `shape`, `architecture`), the
    embedding and the output head; under tensor parallelism it also supplies `reduce`, the in-place
    sum of a partial result over the ranks (after the attention's and the MLP's output projections,
    and of a projection q/k norm's sums of squares), which then splits each layer between compiled
    functions with the sums between them. Under expert parallelism it supplies `exchange`, which runs
    each MoE layer's MLP (uncompiled: its collectives sit between the products)."""

    layers: list[LayerWeights]
    shape: Shape
    architecture: Architecture
    reduce: Callable[[torch.Tensor], None] | None = None
    exchange: ExpertExchange | None = None
    # a gloo group of the ranks whose shards decode the same requests together (tensor parallelism):
    # a turn session's calls must be the same on each, in the same order (agents/ranks.py); None: alone
    lockstep_group = None

    def __init__(self, hf_config, compile: bool, attention: str):
        self.num_layers = len(self.layers)
        self.plans = self.architecture.layers
        self.scale = self.architecture.softmax_scale
        # RoPE tables by key, on the device; cos and sin of each are computed once per step
        used = {plan.rope for plan in self.plans}
        self.tables = {key: (inv_freq.to(self.device), scaling)
                       for key, (inv_freq, scaling) in rope_tables(hf_config).items() if key in used}
        self.windows = {plan.window for plan in self.plans}
        self.attention_name = resolve_attention(attention, self.device)
        self.attention = DECODE_ATTENTION[self.attention_name]
        # A projection q/k norm under tensor parallelism sums over the ranks between the projections
        # and the rest of a layer's inputs: two functions with the sum between them.
        self.split_inputs = self.reduce is not None and self.shape.qk_norm == "projection"
        # The decode step's layer functions; prefill keeps the eager ones (its shapes vary per call).
        self.decode_inputs, self.decode_parts, self.decode_mlp = decode_inputs_written, layer_output_parts, residual_mlp
        self.decode_projections, self.decode_written = decode_projections, decode_written
        self.decode_attention = self.attention.attend
        if compile:
            rows, cache = (0,), (0, 2)  # a step's rows; a cache's slots and length
            self.decode_inputs = compile_varying(decode_inputs_written, {0: rows, 1: rows, 4: rows, 5: rows, 6: cache,
                                                                          7: cache, 8: rows})
            self.decode_projections = compile_varying(decode_projections, {0: rows, 1: rows})
            self.decode_written = compile_varying(decode_written, {0: rows, 1: rows, 2: rows, 3: rows, 5: rows, 6: rows,
                                                                   7: cache, 8: cache, 9: rows})
            self.decode_parts = compile_varying(layer_output_parts, {0: rows, 1: rows})
            self.decode_mlp = compile_varying(residual_mlp, {0: rows, 1: rows})
            if self.attention.compiled:
                self.decode_attention = compile_varying(self.attention.attend, {0: rows, 1: cache, 2: cache, 3: (0, 1)})

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def refresh(self) -> None:
        """Called before every generate call: pick up parameters whose storage was replaced."""

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [b, s, h] as the embedding matrix holds them (summed over the ranks)."""
        raise NotImplementedError

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: logits [b, V] in the model's dtype from hidden states [b, h]."""
        raise NotImplementedError

    def _inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The embeddings [b, s, h] of `ids` (Gemma's scaled) and the rotary (cos, sin) at `positions`
        [b, s] of every RoPE table a layer uses."""
        hidden = scale_embedding(self._embed_tokens(ids), self.architecture.embedding_scale)
        return hidden, {key: rotary_cos_sin(positions, inv_freq, scaling, hidden.dtype)
                        for key, (inv_freq, scaling) in self.tables.items()}

    def new_cache(self, slots: int, length: int, record_routing: bool = False) -> SlotKVCache:
        """The whole length for every layer, windowed ones included (a ring buffer of `window`
        positions per windowed layer would be a later memory saving); `record_routing` (a mixture of
        experts): with the `RoutingRecord` prefill and decode fill."""
        routing = None
        if record_routing:
            experts = self.architecture.experts
            routing = RoutingRecord(self.num_layers, slots, length, experts.top_k, experts.count, self.device)
        return SlotKVCache(self.num_layers, slots, length, self.shape.kv_heads, self.shape.head_dim, self.dtype,
                           self.device, routing)

    def cache_bytes_per_slot_token(self, record_routing: bool = False) -> int:
        kv = SlotKVCache.bytes_per_slot_token(self.num_layers, self.shape.kv_heads, self.shape.head_dim, self.dtype)
        if not record_routing:
            return kv
        experts = self.architecture.experts
        return kv + RoutingRecord.bytes_per_slot_token(self.num_layers, experts.top_k, experts.count)

    @property
    def records_routing(self) -> bool:
        """Whether a call may ask for the experts each token took: a mixture of experts."""
        return self.architecture.experts is not None

    def _attention_inputs(self, hidden: torch.Tensor, w: LayerWeights, cos, sin):
        """q [b, H, s, d], k and v [b, KVH, s, d] of `hidden` [b, s, h]: `projections`, then
        `positioned`, with a projection q/k norm's sums of squares summed over the ranks between."""
        q, k, v, squares = projections(hidden, w, self.shape)
        if squares is not None and self.reduce is not None:
            self.reduce(squares)
        return positioned(q, k, v, squares, w, cos, sin, self.shape)

    def _output_parts(self, hidden: torch.Tensor, attended: torch.Tensor, w: LayerWeights, parts: Callable,
                      mlp: Callable, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer_output_parts` by `parts`; under tensor parallelism the projection, its sum over the
        ranks, `mlp` (`residual_mlp`) and the sum of its output instead; under expert parallelism a MoE
        layer's `residual_mlp` with the exchange (each rank sending `tokens` rows)."""
        if w.experts is not None and self.exchange is not None:
            mlp = partial(residual_mlp, exchange=self.exchange, tokens=tokens)
        elif self.reduce is None:
            return parts(hidden, attended, w, self.shape)
        projected = out_projection(attended, w)
        if self.reduce is not None:
            self.reduce(projected)
        hidden, output = mlp(hidden, projected, w, self.shape)
        if self.reduce is not None:
            self.reduce(output)
        return hidden, output

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache: SlotKVCache,
                starts: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompt tails `ids` [b, s] (real lengths [b]) into `slots` [b] at positions
        `starts` [b] on: each slot already holds the K/V of its positions [0, start) (a prefix kept
        from an earlier call, or none when start is 0). Float32 logits [b, V] of each tail's last token."""
        width, device = ids.shape[1], ids.device
        positions = starts[:, None] + torch.arange(width, device=device)[None]  # [b, s]
        real_rows, real_columns = (torch.arange(width, device=device)[None] < lengths[:, None]).nonzero(as_tuple=True)
        written_slots, written_positions = slots[real_rows], positions[real_rows, real_columns]
        end = int((starts + lengths).max())
        # Query i of a row sees cache positions <= start + i (and within its layer's window): its
        # prefix and its own tail up to itself.
        masks = {window: visible(positions, end, window)[:, None] for window in self.windows}  # [b, 1, s, end]
        hidden, rotary = self._inputs(ids, positions)
        routing = cache.routing
        # under expert parallelism every rank sends as many tokens as the rank with the most
        tokens = None if self.exchange is None else self.exchange.agree([ids.numel()])[0]
        for index, (w, plan) in enumerate(zip(self.layers, self.plans)):
            q, k, v = self._attention_inputs(hidden, w, *rotary.get(plan.rope, (None, None)))
            keys, values = cache.keys[index], cache.values[index]
            keys[written_slots, :, written_positions] = k.transpose(1, 2)[real_rows, real_columns]
            values[written_slots, :, written_positions] = v.transpose(1, 2)[real_rows, real_columns]
            attended = attend_prefill(q, keys[slots, :, :end], values[slots, :, :end], masks[plan.window], self.scale)
            if routing is not None:
                chosen = torch.empty((*ids.shape, w.experts.top_k), dtype=routing.history.dtype, device=device)
                w = recording(w, chosen.view(-1, w.experts.top_k))
            hidden, mlp = self._output_parts(hidden, attended, w, layer_output_parts, residual_mlp, tokens)
            hidden = hidden + norm(mlp, w.post_mlp_norm, self.shape)
            if routing is not None:
                routing.history[written_slots, written_positions, index] = chosen[real_rows, real_columns]
        last = hidden[torch.arange(len(ids), device=device), lengths - 1]  # [b, h]
        return self._head(last).float()

    def idle_prefill(self) -> None:
        """Under expert parallelism, a rank with nothing to prefill while another of its group
        prefills: its experts compute the others' tokens (`ExpertExchange.idle`)."""
        tokens = self.exchange.agree([0])[0]
        self.exchange.idle(self.layers, self.shape, tokens)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache, attended: int,
               seen: torch.Tensor | None = None) -> torch.Tensor:
        """One token per slot of [0, b): `ids`, `positions` [b], every position < `attended`; logits
        [b, V] of the next token in the model's dtype (the sampler reads them in float32: a float32
        copy of a 152k vocabulary would cost a write and a read per step). `seen` [b], where given: the
        last position each row attends to (its position; 0 for a row whose output nobody reads, so an
        idle slot of a long cache costs one position's reads, not its whole length)."""
        rows = len(ids)
        seen = positions if seen is None else seen
        masks = {window: self.attention.mask_of(seen, attended, self.dtype, window) for window in self.windows}
        hidden, rotary = self._inputs(ids[:, None], positions[:, None])
        mlp = torch.zeros_like(hidden)  # the first layer's input has no second term
        # The norm the second term passes through: the previous layer's post-MLP norm; the first
        # layer's zeros stay zeros under any, so it gets its own (one compiled graph for all layers).
        mlp_norm = self.layers[0].post_mlp_norm
        layers = self.layers
        if cache.routing is not None:
            layers = [recording(w, buffer) for w, buffer in zip(self.layers, cache.routing.step)]
        for index, (w, plan) in enumerate(zip(layers, self.plans)):
            keys, values = cache.keys[index], cache.values[index]
            cos, sin = rotary.get(plan.rope, (None, None))
            if self.split_inputs:
                hidden, q, k, v, squares = self.decode_projections(hidden, mlp, mlp_norm, w, self.shape)
                self.reduce(squares)
                q = self.decode_written(q, k, v, squares, w, cos, sin, keys, values, positions, self.shape)
            else:
                hidden, q = self.decode_inputs(hidden, mlp, mlp_norm, w, cos, sin, keys, values, positions, self.shape)
            attended_out = self.decode_attention(q, keys[:rows, :, :attended], values[:rows, :, :attended],
                                                 masks[plan.window], self.scale, plan.window)
            hidden, mlp = self._output_parts(hidden, attended_out, w, self.decode_parts, self.decode_mlp)
            mlp_norm = w.post_mlp_norm
        if cache.routing is not None:
            cache.routing.write_step(positions)
        return self._head((hidden + norm(mlp, mlp_norm, self.shape))[:, 0])


class HFDecoder(Decoder):
    """An HF causal LM of a family `aligner_ext/architecture.py` describes: its own modules' parameters
    (module docstring)."""

    def __init__(self, model, compile: bool = False, fuse_projections: bool = False, attention: str = "auto"):
        config = model.config
        self.architecture = architecture(config)  # UnsupportedModel (a ValueError) names what it cannot run
        self.model = model
        self.base = model.get_decoder()
        self.shape = Shape(config.num_attention_heads, config.num_key_value_heads, self.architecture.head_dim,
                           config.rms_norm_eps, self.architecture.norm, self.architecture.activation,
                           self.architecture.qk_norm)
        self.fuse_projections = fuse_projections
        self.layers = [self._weights(layer) for layer in self.base.layers]
        self.output = model.get_output_embeddings()
        self._check_adapters()
        super().__init__(config, compile, attention)

    def _check_adapters(self) -> None:
        """Refuse adapters on layers other than the attention and MLP projections (the embedding, the
        head, a shared expert's gate), which the decode step would silently run without."""
        projections = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                       "gate_up_proj"}
        for name, module in self.model.named_modules():
            if is_adapted(module) and name.rsplit(".", 1)[-1] not in projections:
                raise ValueError(f"the rollout engine runs LoRA adapters on the attention and MLP projections only, "
                                 f"not on {name} (policy.lora.target_modules); generator.engine=hf runs it")

    def _weights(self, layer) -> LayerWeights:
        attn, mlp, shape = layer.self_attn, layer.mlp, self.shape
        norms = {role: getattr(layer, name).weight for role, name in self.architecture.norm_names.items()}
        if self.architecture.fused_checkpoint:  # Phi-3: q/k/v and gate/up are one matrix each already
            sizes = (shape.num_heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.kv_heads * shape.head_dim)
            qkv = Projection((attn.qkv_proj.weight,), (attn.qkv_proj.bias,), sizes,
                             self._adapters(split_adapter(adapter_of(attn.qkv_proj), sizes)))
            half = mlp.gate_up_proj.weight.shape[0] // 2
            gate_up = Projection((mlp.gate_up_proj.weight,), (mlp.gate_up_proj.bias,), (half, half),
                                 self._adapters(split_adapter(adapter_of(mlp.gate_up_proj), (half, half))))
        else:
            qkv = self._projection([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = None if self.architecture.experts else self._projection([mlp.gate_proj, mlp.up_proj])
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if self.architecture.qk_norm else (None, None)
        attention = (norms.get("input"), qkv, *qk_norms, attn.o_proj.weight, attn.o_proj.bias,
                     norms.get("post_attention"), norms.get("pre_mlp"))
        if self.architecture.experts is not None:
            return LayerWeights(*attention, None, None, None, norms.get("post_mlp"), adapter_of(attn.o_proj),
                                experts=self._experts(mlp))
        return LayerWeights(*attention, gate_up, mlp.down_proj.weight, mlp.down_proj.bias, norms.get("post_mlp"),
                            adapter_of(attn.o_proj), adapter_of(mlp.down_proj))

    def _experts(self, mlp) -> ExpertWeights:
        """A sparse MoE block's tensors (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock): the router
        `gate`, the stacked `experts`, Qwen2-MoE's `shared_expert` (an MLP whose projections may carry
        adapters) and `shared_expert_gate`."""
        pieces = self.architecture.experts
        routed = (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj, pieces.top_k,
                  pieces.normalize_top_k)
        if pieces.shared_ffn_size is None:
            return ExpertWeights(*routed)
        shared = mlp.shared_expert
        return ExpertWeights(*routed, self._projection([shared.gate_proj, shared.up_proj]), shared.down_proj.weight,
                             adapter_of(shared.down_proj), mlp.shared_expert_gate.weight)

    @staticmethod
    def _adapters(adapters: tuple[LowRank | None, ...]) -> tuple[LowRank | None, ...]:
        """`Projection.adapters`: empty when no output has one."""
        return adapters if any(adapter is not None for adapter in adapters) else ()

    def _projection(self, linears: list[torch.nn.Linear]) -> Projection:
        """The linears as one fused product when `fuse_projections` (and their biases all exist or
        all do not), else one product each."""
        weights = [linear.weight for linear in linears]
        biases = [linear.bias for linear in linears]
        sizes = tuple(weight.shape[0] for weight in weights)
        adapters = self._adapters(tuple(adapter_of(linear) for linear in linears))
        has_bias = [bias is not None for bias in biases]
        if not self.fuse_projections or (any(has_bias) and not all(has_bias)):
            return Projection(tuple(weights), tuple(biases), sizes, adapters)
        return Projection((fuse_rows(weights),), (fuse_rows(biases) if all(has_bias) else None,), sizes, adapters)

    def refresh(self) -> None:
        """Fuse again the layers whose parameters no longer view their buffers (module docstring);
        layers still fused keep their buffers, nothing copied."""
        if self.fuse_projections:
            self.layers = [self._weights(layer) for layer in self.base.layers]

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.base.embed_tokens.weight)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(rms_norm(hidden, self.base.norm.weight, self.shape.eps, self.shape.norm))
