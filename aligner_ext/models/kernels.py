"""Fused training kernels for the HF backend's model (`policy.kernels`), and the library's use of
torch.compile.

`liger`: Liger-Kernel's Triton RMSNorm, SwiGLU MLP and rotary embedding patched into the model
instance (extra `liger`; a CUDA device; every family of `LIGER_PATCHES`, GeGLU for Gemma 3, OLMo's
q/k norms over the whole projection too; where the rotary is partial, transformers' own RoPE compiled; for
Qwen3-MoE its norms and RoPE, the experts' SwiGLU being compiled with the experts, models/experts.py). Its fused linear
cross-entropy is left off: the policy computes log-probs from hidden states itself
(models/logprobs.py, chunked), so the model's own head forward never runs in training. Measured
(docs/benchmarks.md) faster at 358M and 1.5B with less memory, so `auto` (the default) takes it
where it runs: a CUDA device, a supported decoder, the package installed; `none` keeps transformers'
modules.

`start_compile_workers` starts torch.compile's worker processes early; `compiled_on_cuda` is how
the library's own small elementwise functions become fused kernels on GPUs (what keeps Triton's
kernels from compiling again for a new prompt width: aligner_ext/widths.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

import torch

from aligner_ext.architecture import architecture
from aligner_ext.errors import ConfigError
from aligner_ext.models.moe import is_moe

KERNELS = ("auto", "none", "liger")
logger = logging.getLogger(__name__)
# model_type -> Liger-Kernel's patch of it (its name is apply_liger_kernel_to_<model_type>)
LIGER_PATCHES = ("llama", "qwen2", "qwen3", "mistral", "ministral", "phi3", "olmo2", "olmo3", "smollm3", "gemma3_text",
                 "qwen3_moe")
GEGLU_MODELS = ("gemma3_text",)  # the gated MLP's activation is GeGLU: Liger's geglu kernel, not its swiglu


def apply_kernels(model, kernels: str) -> str:
    """Patch `model` in place with the kernels `policy.kernels` names; the kernels applied (auto resolved)."""
    if kernels == "auto":
        kernels = "liger" if liger_runs(model) else "none"
        if kernels == "liger":
            logger.info("policy.kernels=auto: Liger-Kernel's fused kernels (none keeps transformers' modules)")
        else:  # the usual case off CUDA (the demo): nothing to report
            logger.debug("policy.kernels=auto: transformers' modules (liger needs CUDA, a listed decoder and the "
                         "extra `liger`)")
    if kernels == "none":
        return kernels
    if next(model.parameters()).device.type != "cuda":
        raise ConfigError("policy.kernels=liger runs Triton kernels: it needs the policy on a CUDA device")
    patch_with_liger(model)
    return kernels


def liger_runs(model) -> bool:
    """A CUDA device, a decoder Liger-Kernel patches, and the package importable."""
    return (next(model.parameters()).device.type == "cuda" and model.config.model_type in LIGER_PATCHES
            and importlib.util.find_spec("liger_kernel") is not None)


def patch_with_liger(model) -> None:
    model_type = model.config.model_type
    if model_type not in LIGER_PATCHES:
        raise ConfigError(f"policy.kernels=liger supports {', '.join(LIGER_PATCHES)} decoders, not {model_type!r}")
    try:
        liger = importlib.import_module("liger_kernel.transformers")
    except ImportError as err:
        raise ConfigError(f"policy.kernels=liger needs Liger-Kernel: pip install 'aligner_ext[liger]' ({err})") from err
    # a mixture of experts' SwiGLU is inside its stacked experts: compiled with them (models/experts.py)
    gated_mlp = {"geglu" if model_type in GEGLU_MODELS else "swiglu": not is_moe(model.config)}
    # Liger's RoPE kernel rotates the whole head: a partial-rotary model (Phi-4-mini) keeps transformers' RoPE
    pieces = architecture(model.config)
    full_rotary = pieces.rotary_dim == pieces.head_dim
    getattr(liger, f"apply_liger_kernel_to_{model_type}")(model=model, rope=full_rotary, rms_norm=True, **gated_mlp,
                                                          cross_entropy=False, fused_linear_cross_entropy=False)
    if not full_rotary:
        compile_partial_rotary(model_type)
    if pieces.qk_norm == "projection":
        patch_projection_qk_norms(model)


def compile_partial_rotary(model_type: str) -> None:
    """transformers' own `apply_rotary_pos_emb` of the family, compiled (as Liger patches the module's
    function with its kernel for whole heads). Eager, a partial rotary's slices, rotate_half and two
    concatenations per layer were 13% of Phi-4-mini's training device time at 1B (docs/benchmarks.md)."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = getattr(modeling.apply_rotary_pos_emb, "_torchdynamo_orig_callable", modeling.apply_rotary_pos_emb)
    modeling.apply_rotary_pos_emb = torch.compile(original, dynamic=True)


def patch_projection_qk_norms(model) -> None:
    """Liger's RMSNorm on OLMo's q/k norms over the whole projection, which its OLMo patches leave as
    transformers' eager float32 module (14% of OLMo 2's training device time at 1B in elementwise
    kernels, docs/benchmarks.md). Casting mode `gemma` with offset 0 is OLMo's formula: the weight
    multiplies in float32 before the cast (`architecture.rms_norm`, `float32_scale`)."""
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module  # keeps the module's Parameter

    for layer in model.get_decoder().layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            _patch_rms_norm_module(norm, offset=0.0, casting_mode="gemma", in_place=False)


def start_compile_workers() -> None:
    """Start torch.compile's pool of compile worker processes now, not at the first compilation.
    Why: until its workers have imported torch (seconds), Inductor compiles each Triton kernel in
    this process, one after another; started while a GPU run loads, the pool compiles the first
    step's kernels in parallel. `TORCH_WARM_POOL=0` turns it off, as it does torch's own start."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def attention_without_plans() -> None:
    """SDPA without cuDNN's attention, which torch tries first on a GPU: cuDNN builds an execution plan
    for every new shape (about 0.5 s forward and 0.5 s backward at 358M on an H200), so a run whose prompt
    widths vary paid it at each new width, in training and in the rollout engine's prefill
    (docs/benchmarks.md, "A new prompt width"). FlashAttention and the memory-efficient kernel need no
    plan. Process-wide, as torch's switch is: the trainer's process owns its GPU
    (`policy.cudnn_attention=true` leaves torch's choice)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def prepare_gpu_process(cudnn_attention: bool) -> None:
    """What a process that trains or generates on a GPU sets up first (`train` and `serve`): the compile
    workers, and SDPA without cuDNN's plans unless `policy.cudnn_attention`."""
    start_compile_workers()
    if not cudnn_attention:
        attention_without_plans()


def compiled_on_cuda(fn, tensor_argument: int = 0):
    """`fn` compiled by torch.compile (shapes dynamic, compiled once, on first use) when its argument at
    `tensor_argument` (the first by default) is a CUDA tensor, and run as it is elsewhere (the CPU tests
    run the same code). Such an argument of fewer than 2 rows runs as it is too: torch.compile specialises sizes 0 and 1, so the
    first such input (a log-prob chunk of one token) would compile a second graph in the middle of
    training (1.7 s of a 3.7 s step at 358M, against 1.5 s for the others; docs/benchmarks.md)."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        tensor = args[tensor_argument]
        if not tensor.is_cuda or tensor.shape[0] < 2:
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    return call
