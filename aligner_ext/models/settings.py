"""Settings of the policy backends and the embedded model.

The dataclasses of their config sections, each field with its rule, kept free of torch and of the code
that uses them: composing and checking a configuration (`aligner-ext config`, `load_config`) never
imports a model library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from aligner_ext.rules import choice, number, plugin

AUTOCAST_CHOICES = ("auto", "bfloat16", "none")


@dataclass
class TinyModelConfig:
    """Size of the built-in model (used only when `model.path` is not set)."""

    hidden_size: int = number(128, ge=1)  # width of the residual stream
    num_layers: int = number(4, ge=1)  # transformer blocks
    num_heads: int = number(4, ge=1)  # attention heads
    num_kv_heads: int = number(2, ge=1)  # key/value heads (grouped-query attention)
    intermediate_size: int = number(512, ge=1)  # MLP width
    max_position_embeddings: int = number(512, ge=2)  # longest prompt + response, in tokens
    seed: int = number(0, ge=0)  # seeds the random initialisation

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"model.tiny.num_heads={self.num_heads}: must divide model.tiny.hidden_size="
                             f"{self.hidden_size} into heads of an even width (rotary embeddings rotate pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.tiny.num_kv_heads={self.num_kv_heads}: must divide model.tiny.num_heads="
                             f"{self.num_heads} (each key/value head serves a group of query heads)")


@dataclass
class WarmupConfig:
    """Supervised warm-up of the embedded model (only when `model.path` is not set)."""

    steps: int = number(200, ge=0)  # optimizer steps; stop early to leave the RL phase something to learn
    drill_steps: int = number(0, ge=0)  # optimizer steps on the built-in task's drills (a skill its gold responses presuppose, e.g. copying numbers: data/tasks/base.py DRILLS) before `steps` on its gold responses; only for a task that registers drills (calculator_arithmetic)
    batch_size: int = number(64, ge=1)  # sequences per step
    lr: float = number(1e-3, gt=0)  # AdamW learning rate
    seed: int = number(0, ge=0)  # order of the examples
    autocast: str = choice("auto", *AUTOCAST_CHOICES)  # auto (bfloat16 autocast on a GPU, none on the CPU) | bfloat16 | none
    cache_dir: str = "auto"  # where warmed models are kept, keyed by the warm-up's inputs, so a task's warm-up runs once per machine (models/warmup_cache.py): a directory | auto ($ALIGNER_EXT_CACHE, else $XDG_CACHE_HOME/aligner_ext, else ~/.cache/aligner_ext; + /warmup) | none


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (one schedule step per RL step)."""

    lr: float = number(1e-6, ge=0)  # peak learning rate (typical for billion-parameter policies; conf/demo.yaml sets the tiny model's)
    weight_decay: float = number(0.0, ge=0)  # AdamW decoupled weight decay
    beta1: float = number(0.9, ge=0, lt=1)  # AdamW first-moment decay
    beta2: float = number(0.999, ge=0, lt=1)  # AdamW second-moment decay
    eps: float = number(1e-8, gt=0)  # AdamW denominator epsilon
    grad_clip: float = number(1.0, ge=0)  # max global gradient L2 norm; 0 disables clipping
    schedule: str = choice("constant", "constant", "linear", "cosine")  # constant | linear | cosine (decay to min_lr_ratio * lr after warm-up)
    warmup_steps: int = number(0, ge=0)  # RL steps of linear warm-up from 0 to lr
    min_lr_ratio: float = number(0.0, ge=0, le=1)  # final lr / peak lr for linear and cosine decay
    max_nonfinite_in_a_row: int = number(3, ge=1)  # an update with a non-finite loss or gradient norm is skipped (and counted); this many in a row stop the run
    max_update_ratio: float = number(0.1, ge=0)  # an update changing the weights' L2 norm by more than this fraction of it diverged: the run stops (exit 2) without saving it (0 disables)
    master_weights: bool = True  # HF backend, bf16 / fp16 weights: AdamW updates float32 copies of them (its moments float32 too) and rounds them into the model after each step, 18 bytes per trainable parameter instead of 8; false: AdamW on the bf16 weights, where an update below a weight's bf16 spacing (lr 1e-6 against 1e-4 to 5e-4 at magnitudes 0.02-0.1) rounds away (models/master_weights.py). The Megatron backend always keeps float32 masters (megatron-core's optimizer; the setting is refused there)


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) trained in place of the policy's weights, which stay frozen (docs/lora.md)."""

    rank: int = number(0, ge=0)  # adapter rank r; 0 = no adapters, every weight trains
    alpha: float = number(16.0, gt=0)  # an adapter's output is scaled by alpha / rank
    dropout: float = number(0.0, ge=0, lt=1)  # dropout on an adapter's input while training (not while generating or scoring)
    target_modules: list[str] = field(default_factory=lambda: [".*_proj"])  # regular expressions: a linear layer gets an adapter when its name, or the name's last part (q_proj), matches one in full; the default takes every attention and MLP projection and leaves the output head
    init: str = choice("kaiming", "kaiming", "gaussian")  # A's initialisation, B starts at zero so training starts from the base model: kaiming (uniform, peft's default) | gaussian (normal, std 1 / rank)

    def __post_init__(self) -> None:
        for pattern in self.target_modules:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"policy.lora.target_modules: {pattern!r} is not a regular expression ({err})") from err


@dataclass
class PolicyConfig:
    """Which backend trains the policy, and how a batch is split for it."""

    backend: str = plugin("hf", "aligner_ext.models.base:POLICIES")  # registered policy backend
    dtype: str = choice("auto", "auto", "float32", "bfloat16", "float64")  # auto (bfloat16 on a GPU that supports it, else float32) | float32 | bfloat16 | float64
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    micro_batch_size: int = number(64, ge=1)  # sequences per forward/backward (memory knob; does not change the gradient)
    mini_batch_size: int = number(0, ge=0)  # sequences per optimizer update; 0 = the whole step batch (one update)
    num_iterations: int = number(1, ge=1)  # passes over each step batch against the stored old log-probs
    old_logprob_pass: str = choice("auto", "auto", "always")  # auto: skipped when the step is one on-policy update (the training forward's detached log-probs are the old ones) | always
    logprob_chunk_size: int = number(4096, ge=1)  # response tokens per chunk of the fused log-prob head (bounds its [tokens, vocab] logits)
    kernels: str = choice("auto", "auto", "none", "liger")  # training kernels: liger (HF backend: Liger-Kernel's Triton RMSNorm, SwiGLU, RoPE, models/kernels.py; megatron backend: Liger's RMSNorm and megatron-core's fused SwiGLU / GeGLU, models/megatron/model.py, less memory; CUDA; extra liger) | none (the plain modules) | auto (liger where it runs: a CUDA device and the package; measured faster on both backends)
    cudnn_attention: bool = False  # on a GPU, let SDPA (the HF backend's padded micro-batches, the rollout engine's prefill, in `train` and `serve`) choose cuDNN's attention, which torch tries first: it builds an execution plan for every new shape (about 0.5 s forward and 0.5 s backward at 358M on an H200), paid again at each new prompt width; false: FlashAttention or the memory-efficient kernel, which need no plan (models/kernels.py)
    tensor_model_parallel_size: int = number(1, ge=1)  # megatron backend: GPUs each layer is split across (TP)
    pipeline_model_parallel_size: int = number(1, ge=1)  # megatron backend: pipeline stages the layers are split into (PP)
    expert_model_parallel_size: int = number(1, ge=1)  # megatron backend, mixtures of experts: ranks the experts are split across (EP; each holds num_experts / EP), within the data-parallel ranks; must divide the expert count and the data-parallel size
    sequence_parallel: bool = False  # megatron backend: shard norm/dropout activations over TP ranks (TP > 1)
    use_distributed_optimizer: bool = False  # megatron backend: shard optimizer state over data-parallel ranks
    micro_batch_tokens: int = number(0, ge=0)  # pack whole sequences end to end into micro-batches of at most this many tokens (both backends; no compute on pads; a longer sequence goes alone); 0 = micro_batch_size rows per micro-batch, padded
    router_aux_loss_coef: float = number(0.0, ge=0)  # mixture-of-experts policies: weight of the router's load-balancing loss added to the policy loss (loss/router_aux, without the weight), over each micro-batch's real tokens, averaged over the mini-batch by tokens; 0 = off, as most RL runs leave it. HF backend: transformers' load_balancing_loss_func (all layers' tokens pooled, E * sum_e f_e P_e with f_e the top-k choices per token, summing to k); Megatron backend: megatron-core's aux_loss (per layer, f_e divided by k, so summing to 1, then summed over the layers): the same coefficient weighs them differently. Expert load and router entropy are in the metrics either way (moe/)
    routing_replay: bool = False  # mixture-of-experts policies (generator.engine=rollout; both backends): every forward over a step's batch (old log-probs, training, KL reference) routes each token to the experts the engine's routers chose for it, weighted by the trainer's own router probabilities at them, instead of its own top k. The share of (token, layer) pairs whose top-k sets differ is in the metrics either way (moe/routing_mismatch)
    recompute_activations: bool = False  # keep only each layer's input and recompute the layer in the backward (less memory, ~1/3 more compute): megatron-core's full recomputation on the Megatron backend, transformers' gradient checkpointing on the HF backend
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"policy.device={self.device!r}: must be auto, cpu, cuda or cuda:N")


def check_lora_engine(lora: LoraConfig, engine: str) -> None:
    """Refuse LoRA with an engine that would hold a second copy of the base weights."""
    if lora.rank > 0 and engine == "vllm":
        raise ValueError(f"policy.lora.rank={lora.rank} with generator.engine=vllm: the colocated vLLM engine holds "
                         "its own copy of the base weights, the memory LoRA saves; generator.engine=rollout or hf "
                         "runs the adapters from the policy's own tensors, generator.engine=remote pushes merged "
                         "weights to servers (docs/lora.md)")
