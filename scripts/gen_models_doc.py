"""docs/models.md from the code's own tables, so that it cannot go stale: the families
(`aligner_ext/architecture.py::FAMILIES`, `models/family_configs.py::LAYOUTS`), the Liger patches of the HF
backend (`models/kernels.py::LIGER_PATCHES`), and for every cell of the support matrix and every
refusal shown, the verdict of the functions that refuse a run (`aligner_ext/support.py`) on the
family's config; the measured speed of every family, from the benchmark results docs/benchmarks.md is
made of (docs/bench_results/). tests/test_models_doc.py fails when the committed page differs.

    python scripts/gen_models_doc.py           # rewrites docs/models.md
    python scripts/gen_models_doc.py --check   # exit 1 if docs/models.md is not what this renders
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import GPT2Config

from aligner_ext.architecture import FAMILIES, LayerPlan, architecture, rope_types
from aligner_ext.models.family_configs import GLOBAL_EVERY, LAYOUTS, MOE_LAYOUTS, family_config
from aligner_ext.models.kernels import LIGER_PATCHES
from aligner_ext.support import long_context_warning, megatron_refusal, rollout_refusal

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import run as bench  # noqa: E402  (scripts/bench/run.py: the benchmark results' family table)

REGENERATE = "python scripts/gen_models_doc.py"
# Every family at one small size that every layout of the matrix splits (heads, MLP, layers by 2).
SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=256)
WORLD = 4  # processes of the Megatron columns: TP=2 or PP=2 leaves DP=2
MEGATRON_LAYOUTS = {"TP=1, DP": (1, 1, False), "TP=2 + SP": (2, 1, True), "PP=2": (1, 2, False)}


def layout_names() -> dict[str, str]:
    """model_type -> the family_configs name of its released layout."""
    return {family_config(name, **SIZES).model_type: name for name in {**LAYOUTS, **MOE_LAYOUTS}}


class Notes:
    """Numbered footnotes holding the refusal lines of the matrix's "no" cells."""

    def __init__(self):
        self.lines: list[str] = []

    def cell(self, refusal: str | None) -> str:
        if refusal is None:
            return "yes"
        if refusal not in self.lines:
            self.lines.append(refusal)
        return f"no [{self.lines.index(refusal) + 1}]"


def windows(name: str, config, plans: tuple[LayerPlan, ...], family) -> str:
    if family.windows == "all":
        return "every layer, where `sliding_window` is set"
    if any(plan.window for plan in plans):
        period = GLOBAL_EVERY[name]
        return f"layers typed `sliding_attention` (released: {period - 1} of every {period})"
    return "none unless `use_sliding_window`" if getattr(config, "use_sliding_window", None) is False else "none"


def mlp_cell(arch) -> str:
    gated = "SwiGLU" if arch.activation == "silu" else "GeGLU (tanh)"
    experts = arch.experts
    if experts is None:
        return gated
    shared = ", a gated shared expert" if experts.shared_ffn_size else ""
    weights = "renormalised" if experts.normalize_top_k else "not renormalised"
    return f"{gated} experts (released: {experts.count}, top {experts.top_k}, weights {weights}{shared})"


def families_table() -> list[str]:
    names = layout_names()
    lines = ["| family (`model_type`) | norm | placement | q/k norm | MLP | q/k/v bias | embedding | RoPE (released) "
             "| no-RoPE layers | sliding windows | checkpoint |", "| --- " * 11 + "|"]
    for model_type, family in FAMILIES.items():
        config = family_config(names[model_type], **SIZES)
        arch = architecture(config)
        bias = {"always": "always", "never": "never", "attention_bias": "`attention_bias`"}[family.qkv_bias]
        lines.append(
            f"| {family.name} (`{model_type}`) | {family.norm} | {family.placement} | {family.qk_norm or '-'} "
            f"| {mlp_cell(arch)} | {bias} "
            f"| {'times sqrt(hidden)' if family.embedding_scaled else 'plain'} "
            f"| {', '.join(f'`{kind}`' for kind in sorted(rope_types(config)))} "
            f"| {'where `no_rope_layers[i] == 0`' if family.no_rope_layers else '-'} "
            f"| {windows(names[model_type], config, arch.layers, family)} "
            f"| {'q/k/v and gate/up fused' if family.fused_checkpoint else 'separate matrices'} |")
    return lines


def support_table() -> tuple[list[str], list[str]]:
    names, notes = layout_names(), Notes()
    header = (["family", "HF backend", "HF backend, `policy.kernels=liger`"]
              + [f"Megatron {layout}" for layout in MEGATRON_LAYOUTS]
              + ["HF engine", "rollout engine, HF backend", "rollout engine, Megatron backend", "generation servers"])
    lines = ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    liger = f"policy.kernels=liger patches {', '.join(LIGER_PATCHES)} only (models/kernels.py); policy.kernels=none runs it"
    for model_type, family in FAMILIES.items():
        config = family_config(names[model_type], **SIZES)
        megatron = [megatron_refusal(config, tp, pp, sp, WORLD) for tp, pp, sp in MEGATRON_LAYOUTS.values()]
        rollout = rollout_refusal(config)
        cells = ["yes", notes.cell(None if model_type in LIGER_PATCHES else liger)]
        cells += [notes.cell(refusal) for refusal in megatron]
        cells += ["yes", notes.cell(rollout), notes.cell(megatron[0] or rollout),
                  "the server's [s]"]
        lines.append(f"| {family.name} (`{model_type}`) | " + " | ".join(cells) + " |")
    footnotes = [f"{index}. {line}" for index, line in enumerate(notes.lines, 1)]
    return lines, footnotes


def refusal_examples() -> list[str]:
    """Each refusal the check makes, as the run prints it, with what it means and what to do."""
    llama = family_config("llama3", **SIZES)
    cases = [
        ("an unknown family", megatron_refusal(GPT2Config(n_layer=2, n_embd=32, n_head=2)),
         "The model is none of the families above. Train it on the HF backend and generate with the HF engine "
         "(or a generation server that runs it); the other combinations need the family added to `FAMILIES` "
         "(its pieces, if they are already among those of the table above, are one entry)."),
        ("an activation", rollout_refusal(family_config("llama3", **SIZES, hidden_act="gelu")),
         "The MLP's activation is neither silu (SwiGLU) nor gelu_pytorch_tanh (GeGLU). HF backend and HF engine."),
        ("biases on the MLP", rollout_refusal(family_config("llama3", **SIZES, mlp_bias=True)),
         "`mlp_bias=True`: gate/up/down biases, which no family has. HF backend and HF engine."),
        ("attention biases where the family has none", rollout_refusal(family_config("llama3", **SIZES, attention_bias=True)),
         "Llama's `attention_bias` also biases o_proj, which the pieces do not cover (Qwen2's q/k/v biases they do). "
         "HF backend and HF engine."),
        ("logit soft-capping", rollout_refusal(family_config("gemma3_text", **SIZES, attn_logit_softcapping=50.0)),
         "`attn_logit_softcapping` / `final_logit_softcapping` (Gemma 2's tanh caps; Gemma 3 released none). "
         "HF backend and HF engine."),
        ("bidirectional attention", rollout_refusal(family_config("gemma3_text", **SIZES, use_bidirectional_attention=True)),
         "`use_bidirectional_attention` (EmbeddingGemma): not a causal decoder. HF backend and HF engine."),
        ("a TP that splits a head", megatron_refusal(llama, 4, 1, False, 4),
         "Tensor parallelism gives each rank whole key/value heads (and their query heads), whole MLP columns and "
         "whole rows of the vocabulary padded to a multiple of 128; the line lists the sizes that do divide."),
        ("a PP that splits the layers unevenly", megatron_refusal(llama, 1, 3, False, 3),
         "Each pipeline stage holds the same number of layers; the line lists the sizes that divide them."),
        ("a layout the processes do not hold", megatron_refusal(llama, 2, 1, False, 1),
         "TP x PP must divide the processes torchrun starts (the rest is data parallelism)."),
    ]
    lines = []
    for title, line, meaning in cases:
        lines += [f"- **{title}**: {meaning}", "", f"      aligner-ext: error: {line} (UnsupportedModel; ...)", ""]
    return lines


def render() -> str:
    families_lines = families_table()
    support_lines, footnotes = support_table()
    phi = family_config("phi3", **SIZES)
    warning = long_context_warning(phi, 2 * phi.rope_parameters["original_max_position_embeddings"])
    sections = [
        "# Models: which families run where",
        "",
        f"Generated by `{REGENERATE}` from the code's own tables; do not edit by hand.",
        "",
        "The HF policy backend (`policy.backend=hf`) and the HF engine (`generator.engine=hf`) run every causal "
        "LM transformers runs. The Megatron backend and the rollout engine run the decoder families below, "
        "read from the model's `config.json` (`aligner_ext/architecture.py`). A run decides from "
        "config.json alone, before the tokenizer or any weight loads and, under torchrun, before any rank "
        "builds a model, whether its backend and engine run the model (`aligner_ext/support.py::check_run`): "
        "if not, it prints one line naming the family, the field and its value and what runs the model instead, "
        "and exits with status 2 (every rank; rank 0 alone prints). `generator.engine=auto` never refuses: it "
        "generates with the HF engine where the rollout engine does not run the model, saying why in one INFO line.",
        "",
        "## Support matrix",
        "",
        f"Each cell is the verdict of `aligner_ext/support.py` on the family's released layout "
        f"(`family_configs.py`) at a small size whose heads, MLP and layers split in two; the Megatron "
        f"columns assume {WORLD} processes. A \"no\" cell's note is the line the run prints. "
        "Whether a given checkpoint splits at a given TP or PP depends on its sizes (refusals below).",
        "",
        *support_lines,
        "",
        *footnotes,
        *([""] if footnotes else []),
        "[s] Generation servers (`generator.engine=remote`, docs/serving.md) run what their engine runs: "
        "`aligner-ext serve` the HF engine for every model and the rollout engine as in its column; vLLM "
        "(`generator.engine=vllm` or vLLM servers) what vLLM's own model registry holds. The weights pushed to "
        "them are HF tensors, whatever the policy backend.",
        "",
        "## What each family is made of",
        "",
        "The pieces `architecture()` combines (the module docstring of aligner_ext/architecture.py says what each "
        "is); the RoPE column lists the `rope_type`s of the released configs (`family_configs.py`).",
        "",
        *families_lines,
        "",
        "## Refusals: what each means and what to do",
        "",
        "The run's lines, as the check prints them for a model of the kind named:",
        "",
        *refusal_examples(),
        "## RoPE scaling",
        "",
        "The Megatron backend and the rollout engine take RoPE's tables from transformers' own initialisation: "
        "`architecture.rope_tables` instantiates the model's rotary module (e.g. `Gemma3RotaryEmbedding`) on the "
        "CPU and reads its inverse frequencies and attention scaling, one table per layer type where the model "
        "keeps several (Gemma 3's and OLMo 3's local and global bases). So every `rope_type` transformers "
        "defines, and partial rotary (`partial_rotary_factor`: RoPE on the leading dimensions of each head, "
        "Phi-4-mini's 0.75), is computed exactly as transformers computes it:",
        "",
        "- `default`: frequencies theta^(-2i/d) over the d rotated dimensions.",
        "- `linear`: those divided by `factor` (position interpolation; Gemma 3's global layers, factor 8).",
        "- `llama3`: wavelengths shorter than `original_max_position_embeddings / high_freq_factor` keep their "
        "frequency, those longer than `original_max_position_embeddings / low_freq_factor` are divided by "
        "`factor`, those between are interpolated smoothly (Llama 3.1-3.3).",
        "- `yarn`: per band, between the original and the interpolated frequency (by `beta_fast`, `beta_slow` "
        "and `original_max_position_embeddings`), and cos/sin scaled by an attention factor (0.1 ln(factor) + 1 "
        "unless given).",
        "- `dynamic` (NTK): the base grows with the sequence length L past `max_position_embeddings`: "
        "theta x (factor x L / max_position_embeddings - (factor - 1))^(d / (d - 2)); at or below it, the "
        "default frequencies.",
        "- `longrope`: the frequencies divided per dimension by `short_factor` while sequences stay within "
        "`original_max_position_embeddings` and by `long_factor` past it, cos/sin scaled by "
        "sqrt(1 + ln(s) / ln(original_max_position_embeddings)), s = max_position_embeddings / "
        "original_max_position_embeddings (Phi-3, Phi-4-mini).",
        "",
        "`llama3`, `linear` and `yarn` are fixed tables: the backends and transformers agree at every length.",
        "",
        "## Dynamic and LongRoPE: the decision",
        "",
        "transformers recomputes the `dynamic` and `longrope` frequencies in every forward from the longest "
        "sequence of the batch, so its model changes with the batch: a sequence's log-probs differ depending on "
        "what it is batched with, and token by token generation switches tables mid-sequence. The Megatron backend "
        "and the rollout engine keep the tables transformers sets at load (LongRoPE's short factors, dynamic's "
        "base frequencies), which are the ones it uses while every sequence stays within the length it switches "
        "at: `original_max_position_embeddings` for LongRoPE, `max_position_embeddings` for dynamic. Within "
        "it the two agree exactly; past it they differ, and so would transformers with itself between "
        "generation and training. A run whose `data.max_prompt_length + rollout.max_response_length` passes "
        "that length logs one warning, e.g.:",
        "",
        f"    WARNING aligner_ext.support: {warning}",
        "",
        "Keep the limits within it (Phi-4-mini: 4096 tokens), or accept that longer sequences are scored with "
        "the tables of shorter ones.",
        "",
        "## Sliding windows",
        "",
        "A windowed layer's query sees itself and the `sliding_window - 1` positions before it (transformers' "
        "convention). Which layers are windowed is read from the config (`LayerPlan.window`): Mistral and "
        "Phi-3 window every layer when `sliding_window` is set (Mistral 7B v0.1: 4096; later releases set "
        "none); Ministral, OLMo 3 and Gemma 3 window the layers `layer_types` marks `sliding_attention` (the "
        "others attend globally); Qwen2, Qwen3 and SmolLM3 carry a `sliding_window` size that they ignore "
        "unless `use_sliding_window` is set. The rollout engine's KV cache of a windowed layer needs only the "
        "last window of positions, so its decoding reads at most that many per step "
        "(scripts/bench/families.py counts the decode bound so).",
        "",
        "## NoPE layers",
        "",
        "SmolLM3 leaves RoPE out of every fourth layer (`no_rope_layers[i] == 0`, from "
        "`no_rope_layer_interval`): those layers attend over unrotated queries and keys (`LayerPlan.rope` is "
        "None).",
        "",
        "## Measured speed at ~1B",
        "",
        "Every family at hidden 2048, 16 layers, 32 query / 8 key-value heads, MLP 8192, with its own "
        "vocabulary, RoPE, windows and norms, on one H100: the engine `generator.engine=auto` picks, "
        "decoding in the GRPO step against its bound, training MFU on both backends, the whole GRPO step "
        "(HF backend) and peak memory; each rate also as a multiple of Llama's measured in the same call, "
        "in bold under 0.85. Commands, dates and the profiles: [docs/benchmarks.md](benchmarks.md).",
        "",
        bench.families_table(),
        "",
        "## LoRA adapters",
        "",
        "`policy.lora.rank > 0` trains low-rank adapters instead of the weights on both backends, for every "
        "family above (and, on the HF backend, every model whose projections are `torch.nn.Linear`): the HF "
        "backend's through peft, the Megatron backend's on its column- and row-parallel linears, sharded as "
        "their weights; the rollout engine runs them from the policy's own tensors. What is stored, what "
        "generation servers get and the decisions: [docs/lora.md](lora.md).",
        "",
        "## Mixtures of experts",
        "",
        "Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, ...) train on the HF backend and generate "
        "with the HF engine or a generation server. Qwen3-MoE and Qwen2-MoE also train on the Megatron backend, "
        "on megatron-core's MoE layer (its router and token dispatch; `models/megatron/model.py`::`moe_options`), "
        "whose local experts run as two grouped products (`torch._grouped_mm`) over megatron-core's own expert "
        "parameters rather than its `SequentialMLP`'s loop of one MLP per expert (`models/megatron/experts.py`; it "
        "falls back to that loop where the grouped form would compute something else: an adapter's hook on an "
        "expert, an activation other than SwiGLU, fp8; tested against it, outputs and gradients, in "
        "`tests/megatron/test_grouped_experts.py`): at TP=1, PP=2, and TP=2 with sequence parallelism, which "
        "megatron-core's MoE layer requires under tensor parallelism (refused in one line without it). With expert parallelism "
        "(`policy.expert_model_parallel_size=EP`) each of EP data-parallel ranks holds num_experts / EP of the "
        "experts; on the CPU, at EP=2 and at TP=2 with sequence parallelism x EP=2, log-probs and gradients equal "
        "transformers' (float64), one train call equals the HF backend's, and a checkpoint saved at EP=2 resumes at "
        "EP=1 (docs/megatron.md); multi-GPU figures are to come. The conversion maps transformers' "
        "stacked expert tensors onto the experts' MLPs bit for bit, and reads and writes checkpoint files with "
        "their experts one by one, as released checkpoints hold them. Not there yet on the Megatron backend: "
        "LoRA (refused in one line). The rollout engine "
        "runs them on both backends: on the HF backend from transformers' own parameters "
        "(`generation/decoder.py::experts_mlp`), on the Megatron backend from the GPTModel's own TP shards "
        "(`models/megatron/decoder.py`: each layer's local experts stacked as transformers stacks them, a copy of "
        "this rank's own stage's experts refreshed before each generate call, the other pipeline stages' experts "
        "views of the pipeline gather's buffers): "
        "transformers' routing op for op, so the engine takes the experts the trainer takes; in bfloat16 the "
        "chosen experts' products grouped over all experts by `torch._grouped_mm`, as transformers' default "
        "experts compute them, with no host sync, so each decode step stays one CUDA graph; in float32 and "
        "float64 (which `torch._grouped_mm` takes on a GPU only with a host sync, or not at all) a gather of "
        "each token's experts' weights, whose memory grows with the tokens of a step: for checks at small "
        "sizes. LoRA on the attention and a shared expert runs too (on the HF backend). Under expert parallelism "
        "each rank holds only its experts and decodes its own requests: each MoE layer trades the tokens over the "
        "expert-parallel group (all-gather, this rank's experts, reduce-scatter: "
        "`generation/decoder.py::ExpertExchange`), the group's ranks decoding in lockstep (docs/megatron.md). On "
        "the CPU the engine on the Megatron shards (TP=1, TP=2 with sequence parallelism, PP=2, and EP=2 alone, "
        "with TP=2 + SP and with PP=2) gives the HF engine's "
        "greedy tokens and log-probs and records the HF model's experts; its routing picks megatron-core's router's "
        "experts (`tests/megatron/test_megatron_rollout.py`); on two H200s at EP=2 its log-probs differ from the "
        "trainer's as much as at EP=1 (docs/benchmarks.md, \"Expert parallelism on two GPUs\"). On both backends every "
        "training forward reports what the routers did, pooled over the mini-batch's real tokens "
        "(`models/moe.py::RouterTally`; the Megatron backend records megatron-core's routers and sums over "
        "its ranks, `models/megatron/moe.py`): per layer, the largest expert's share of the top-k choices "
        "times the number of experts (`moe/load_max/layer_N`, 1.0 when balanced) and the router's entropy in "
        "nats (`moe/router_entropy/layer_N`), with their means over the layers (`moe/load_max`, "
        "`moe/router_entropy`). `policy.router_aux_loss_coef` adds a load-balancing loss (logged as "
        "`loss/router_aux`, without the coefficient) times that coefficient to the policy loss, over each "
        "micro-batch's real tokens and averaged over the mini-batch by tokens as the policy loss is; 0, the "
        "default, leaves it out, as most RL runs of these models do. The two backends take their library's own "
        "loss, which differ: the HF backend transformers' `load_balancing_loss_func` of the family, Switch "
        "Transformer's E * sum_e f_e P_e over all layers' tokens pooled, f_e the share of tokens whose top k "
        "holds expert e (summing to k over the experts); the Megatron backend megatron-core's `aux_loss` "
        "(`moe_utils.switch_load_balancing_loss_func`), the same product per layer with f_e divided by k (summing "
        "to 1), summed over the layers: about layers / k times transformers' for the same routing, so a "
        "coefficient does not carry over between the backends unchanged. On the Megatron backend each micro-batch's "
        "loss, over its real tokens (megatron-core's padding mask), is weighted by its share of the update's "
        "real tokens (`models/megatron/moe.py`; megatron-core's own weighting by the rank's token count serves "
        "schedules that divide by the tokens afterwards, which this backend's losses already are). A dense model "
        "with a coefficient above 0 is refused in one line. LoRA's default targets (`.*_proj`) take the attention "
        "projections and a shared expert's, not the routed experts, whose weights transformers keeps as "
        "stacked tensors rather than linear layers.",
        "",
        "### The engine's expert choices in training",
        "",
        "The rollout engine routes as the trainer does, op for op, but not on the same numbers: other kernels, "
        "batch shapes and bfloat16 roundings move a router's inputs, and where a token's k-th and (k+1)-th "
        "experts are close the two take different sets, so that the importance ratio of a token compares two "
        "different models. When the policy is a mixture of experts (on either backend), the experience makers ask "
        "the engine for its choices (`SamplingParams.return_routing`; nothing is recorded otherwise). The rollout "
        "engine records each layer's top k for every token it feeds through the model (the prompt in the "
        "prefill, each generated token but the last in the decode step): `experts_mlp` writes them into a static "
        "buffer per layer during the decode step (no host sync: the step stays one CUDA graph) and one indexed "
        "write per step moves them into a record beside the KV cache, per slot and position ([slots, length, "
        "layers, k], uint8 up to 256 experts, `generation/decoder.py::RoutingRecord`), copied with the K/V where "
        "a prompt's prefill is shared or a kept prefix reused; a finished request's rows are copied out on the "
        "device before another request takes its slot. They reach the batch as `prompt_routing` and "
        "`response_routing` (int16, laid out as the ids, -1 where nothing was recorded: pads and each response's "
        "last token) and follow its rows through dynamic sampling's filtering and refills. The first forward over "
        "a step's tokens (the old-log-prob pass, or the training forward where it gives the old log-probs) "
        "compares the trainer's routers with them (`models/moe.py::RoutingMismatch`, pooled on the device): "
        "`moe/routing_mismatch` is the share of (token, layer) pairs whose top-k sets differ, order aside, over "
        "the recorded tokens, with its value per layer (`moe/routing_mismatch/layer_N`) and the share of tokens "
        "that differ in any layer (`moe/routing_mismatch_tokens`). The Megatron backend counts on each rank its "
        "tokens (a TP rank's sequence shard under sequence parallelism) and its stage's layers, and sums over "
        "the ranks (a token differs where it does in a layer of any pipeline stage), so every rank reports the "
        "same shares (`models/megatron/moe.py`).",
        "",
        "`policy.routing_replay=true` makes every forward over the step's batch (the old log-probs, the training "
        "forward and its recomputation under `policy.recompute_activations`, and the KL reference, so that the "
        "KL compares both models on the same experts and is 0 before the first update) route each recorded "
        "token to the engine's experts, weighted by the trainer's own router probabilities at them (softmax in "
        "float32 over all experts, gathered, renormalised where the family renormalises its top k, cast back): "
        "the router still gets its gradient through those weights, as through transformers' top-k weights. On "
        "the Megatron backend megatron-core's own replay (`RouterReplay`) takes them, one per router, outside "
        "its class-wide list (the policy and the KL reference each drive their own); its weights are the same: "
        "the gathered float32 softmax where the family does not renormalise (Qwen2-MoE), the softmax of the "
        "gathered logits, which is the gathered softmax renormalised, where it does (Qwen3-MoE); a layer "
        "recomputed in the backward replays its micro-batch's experts again. The "
        "expert load, router entropy and load-balancing loss stay those of the trainer's own logits. Per "
        "variant: dynamic sampling (DAPO) and MTPO carry the routing (an MTPO sample takes round 1's over the "
        "prompt and answer, the experts its answer was sampled under, and round 2's from the answer's last "
        "token on); CPO trains on the generated tokens and carries it, while its hinted pass scores sequences "
        "the engine never ran, with the trainer's own routers; the graded system prompt generates from prompts "
        "the policy does not train on, so its graded rows carry none (left out of the mismatch) and replay is "
        "refused unless `graded_prompt.keep_in_training=true`. Replay is refused in one line for a dense model "
        "and for an engine that records no routing (`generator.engine` other than rollout, or `auto` where it "
        "takes the HF engine). On the CPU, at DP=2, TP=2 with sequence parallelism, PP=2, packed micro-batches "
        "with activation recomputation and EP=2, the Megatron backend's mismatch equals hand counts, its "
        "load-balancing loss megatron-core's formula computed in float64, and its replayed log-probs, KL "
        "reference and router gradients the HF backend's (`tests/megatron/test_megatron_routing.py`).",
        "",
        "Measured on one H200 at a 3.0B Qwen3-MoE shape with random weights (docs/benchmarks.md, \"A mixture "
        "of experts on one GPU\"): 4.8-5.0% of the (token, layer) pairs differ between the engine and the "
        "trainer in bfloat16 with transformers' eager modules in training, recording costs no measurable decode "
        "time, and replay narrows the log-prob gap between them (`rollout/logprob_diff_mean` 0.0057 to 0.0046) "
        "at no cost in step time. On the HF backend the experts train through transformers' `grouped_mm` "
        "function compiled (`models/experts.py`) and Qwen3-MoE's norms and RoPE through Liger-Kernel "
        "(`policy.kernels=auto`): at 16 sequences of 768 tokens per micro-batch the step trains at 31.5% MFU on "
        "active parameters (9.2% before, at 4 sequences with transformers' eager experts), 8.9x faster than "
        "TRL's fast mode; the trainer's roundings then differ more from the engine's, which reproduce "
        "transformers' eager modules, and 5.8-5.9% of the pairs differ (at 8 layers: 4.1-4.4% with "
        "`policy.kernels=auto`, 3.4-3.7% with `none`, 3.2-3.4% before); replay trains on the engine's experts "
        "whatever the kernels. Mixtures of experts train faster with larger micro-batches: each expert's "
        "product has about tokens x k / experts rows. On the Megatron backend the grouped expert products "
        "made a train call with Qwen3-30B-A3B's experts (4 layers, one H200) 3.7 times faster than megatron-core's "
        "`SequentialMLP` (0.69 s against 2.55 s, 11.5% MFU against 3.1%), and the 12-layer model at EP=2 on two "
        "H200s trains at 18.0% MFU (4.7% before; docs/benchmarks.md, \"Grouped expert products on the Megatron "
        "backend\"). Not measured yet: a released model's mismatch (random routers have many near ties) and "
        "packed micro-batches.",
        "",
        "## A random-weight checkpoint of a family",
        "",
        "`aligner_ext.models.family_configs.family_config(name, **sizes)` gives the HF config of a family's "
        "released layout (its vocabulary, RoPE, windows, norms) at the sizes given; names: "
        f"{', '.join(f'`{name}`' for name in {**LAYOUTS, **MOE_LAYOUTS})}. For a try without a download:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from aligner_ext.models.family_configs import family_config",
        "import sys; sys.path.insert(0, 'scripts/bench')",
        "from grpo_step_lib import build_word_tokenizer  # a word-level tokenizer of any vocabulary size",
        "",
        "config = family_config('gemma3_text', hidden_size=256, num_hidden_layers=6, num_attention_heads=4,",
        "                       num_key_value_heads=1, head_dim=64, intermediate_size=1024, max_position_embeddings=2048)",
        "AutoModelForCausalLM.from_config(config).save_pretrained('gemma3-tiny')",
        "build_word_tokenizer(config.vocab_size).save_pretrained('gemma3-tiny')",
        "```",
        "",
        "then `aligner-ext train model.path=gemma3-tiny policy.backend=megatron ...`. "
        "scripts/bench/families.py builds ~1B checkpoints of every family the same way.",
        "",
        "**The tokenizer such a directory holds is the one a run uses.** transformers' `AutoTokenizer` picks the "
        "class registered for the config's model type over the class the directory declares, and for `qwen2` that "
        "class (`Qwen2Tokenizer`) rebuilds a custom tokenizer from its vocabulary with byte-level pre-tokenising: "
        "the word tokenizer above would turn a prompt of 256 words into 3 tokens, the embedded character tokenizer "
        "would lose every space, and nothing would fail. Runs and servers load the tokenizer through "
        "`data/tokenizer.py`, which checks the class transformers chose against the directory's `tokenizer.json` "
        "on a probe text and, where they encode differently, loads the file's own tokenizer with one warning "
        "naming both. A released checkpoint's tokenizer class reproduces its file and is kept. Every step logs "
        "`prompt/length_mean|max`, so prompts of an unexpected length show in the run's metrics.",
    ]
    return "\n".join(sections) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/models.md differs from the rendering")
    args = parser.parse_args()
    text = render()
    if args.check:
        sys.exit(0 if DOC.exists() and DOC.read_text(encoding="utf-8") == text else 1)
    DOC.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
