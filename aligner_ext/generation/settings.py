"""Settings of the generation engines.

The dataclasses of their config sections, each field with its rule, kept free of torch and of the code
that uses them: composing and checking a configuration (`aligner-ext config`, `load_config`) never
imports a model library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aligner_ext.rules import choice, number
from aligner_ext.secrets import read_secret

# The lowest sampling temperature above 0: below it a temperature only turns sampling into argmax, while
# logits divided by it overflow float32 (1e-38 and under: inf, then NaN log-probs); 0 asks for greedy.
MIN_TEMPERATURE = 1e-5

WEIGHT_SYNC_MODES = ("none", "disk", "distributed")
SERVER_KINDS = ("sglang", "vllm")
ROUTING = ("round_robin", "least_loaded")
ATTENTION_CHOICES = ("auto", "sdpa", "flex", "triton")  # auto and the kernels of generation/decoder.py


@dataclass
class HFEngineConfig:
    """Settings of the in-process transformers engine."""

    batch_size: int = number(256, ge=1)  # sequences per forward pass; larger calls are split into chunks of this size
    reuse_prompt_prefill: bool = False  # run the prompt forward once per distinct prompt of a chunk and copy its KV cache to the duplicates


@dataclass
class RolloutEngineConfig:
    """Settings of the rollout engine (generation/rollout.py)."""

    max_batch_size: int = number(256, ge=1)  # KV-cache slots: sequences decoded together
    kv_cache_memory_share: float = number(0.5, gt=0, le=1)  # on a GPU, the share of free memory the KV cache may take (fewer slots if it does not fit)
    share_prompt_prefill: bool = True  # prefill identical prompts of one admission once and copy their KV rows
    prefix_cache: bool = True  # keep a call's KV cache for the next call: a prompt that extends a kept sequence prefills only its new tokens (MTPO's round 2)
    cuda_graphs: bool = True  # on a GPU, replay the decode step from CUDA graphs (ignored on the CPU)
    compile: bool = True  # on a GPU, torch.compile the decode step's layer functions and the sampler, and draw with the Triton race (ignored on the CPU)
    attention: str = choice("auto", *ATTENTION_CHOICES)  # decode attention kernel: auto (triton on a GPU, sdpa on the CPU) | sdpa (torch SDPA: cuDNN / flash) | flex (FlexAttention, compiled on a GPU) | triton (flash-decoding Triton kernel, GPU)
    fuse_projections: bool = True  # q/k/v and gate/up as one product each: the parameters become views of one buffer per group (no copy)
    attended_length_step: int = number(128, ge=1)  # sdpa / flex: a decode step attends over the smallest multiple of this many cache positions that covers every sequence (triton reads each sequence to its own position)


@dataclass
class RemoteEngineConfig:
    """Settings of the remote engine (generation/remote.py)."""

    urls: list[str] = field(default_factory=list)  # base URLs of the generation servers, e.g. http://node1:8000
    api_key: str | None = field(default=None, repr=False)  # sent as `Authorization: Bearer <api_key>`; never written to the run directory (aligner_ext/secrets.py): prefer api_key_env / api_key_file
    api_key_env: str | None = None  # environment variable holding api_key (used when api_key is not given)
    api_key_file: str | None = None  # file whose first line is api_key (used when neither api_key nor api_key_env is given)
    model: str | None = None  # model id to request; unset: the first id each server's /v1/models lists
    concurrency: int = number(4, ge=1)  # requests in flight per server
    max_prompts_per_request: int = number(64, ge=1)  # prompts per completions request (a call is cut into chunks of at most this many)
    routing: str = choice("least_loaded", *ROUTING)  # which server takes the next chunk: round_robin | least_loaded (fewest in flight)
    timeout_s: float = number(600.0, gt=0)  # limit per request (each retry has its own), seconds
    max_retries: int = number(3, ge=0)  # retries per request after a connection error, timeout, 408, 429 or 5xx (exponential backoff)
    weight_sync: str = choice("none", *WEIGHT_SYNC_MODES)  # how updated weights reach the servers: none | disk | distributed (docs/serving.md)
    weight_sync_dir: str | None = None  # disk: a directory the servers can read (the trainer writes model.safetensors there)
    weight_sync_address: str | None = None  # distributed: this machine's address as the servers reach it; unset: its host name
    weight_sync_port: int = number(0, ge=0, le=65535)  # distributed: TCP port of the weight group's store; 0 picks a free one
    weight_sync_backend: str = choice("auto", "auto", "nccl", "gloo")  # distributed: nccl | gloo | auto (nccl when the policy is on a GPU); vllm servers: nccl only
    server_kind: str = choice("sglang", *SERVER_KINDS)  # whose weight-update endpoints the servers speak: sglang (SGLang's; aligner-ext serve) | vllm (docs/serving.md)

    def __post_init__(self) -> None:
        self.api_key = read_secret(self.api_key, self.api_key_env, self.api_key_file, "generator.remote.api_key")
        if self.server_kind == "vllm" and self.weight_sync_backend == "gloo":
            raise ValueError("generator.remote.weight_sync_backend=gloo: vLLM's workers receive weights over NCCL only "
                             "(server_kind=vllm); use nccl or auto")


def check_remote_engine(engine: str, remote: RemoteEngineConfig) -> None:
    """What the remote engine refuses when it is built (generation/remote.py), at load."""
    if engine != "remote":
        return
    if not remote.urls:
        raise ValueError("generator.engine=remote needs generator.remote.urls (the servers' base URLs)")
    if remote.weight_sync == "disk" and not remote.weight_sync_dir:
        raise ValueError("generator.remote.weight_sync=disk needs generator.remote.weight_sync_dir, a directory the "
                         "servers can read")
