"""The `remote` engine: rollouts from OpenAI-compatible generation servers, token in, token out.

A call's prompts are cut into contiguous chunks, one completions request each (prompts as token-id
lists, `return_token_ids`), sent concurrently to the servers of `generator.remote.urls`
(round-robin, or to the server with the fewest requests in flight) through the maintained `openai`
client, which retries connection errors, 408/429/5xx with exponential backoff and bounds each
request by `timeout_s`. A server still failing after its retries ends the call with an error naming
it: never a hang. Generated ids come back as ids (`token_ids`: ours and vLLM >= 0.10.2 with
`return_token_ids`), so nothing is re-tokenised; a server that does not return them is an error.

Seeds: sample k of a call seeded s is drawn from seed `request_seed(s, k)` (generation/sampler.py, the
rollout engine's stream of request k), so every sample of a group has its own seed. A request is
seeded with the seed of its first sample: our server draws each of a request's samples from its own
stream; vLLM seeds every prompt of a request alike (identical prompts: identical samples) and child j
of a prompt asked with `n` from seed + j, so with `server_kind=vllm` a seeded sampling call sends one
request per run of identical prompts (a group) with `n`, its sample k then seeded `request_seed(s, k)`
whatever the chunking or the number of servers. Greedy tokens equal the in-process engine's.

Weights: `update_weights`, called by the loop after each optimizer step, pushes the policy's
parameters to every server (`weight_sync`): `disk` writes them as safetensors to `weight_sync_dir`
(a directory the servers can read) and calls /update_weights_from_disk; `distributed` broadcasts
every parameter from trainer rank 0 over a process group of its own (generation/weight_group.py;
NCCL on GPUs, gloo on CPU) through /init_weights_update_group once and
/update_weights_from_distributed each time; `none` leaves the servers' weights alone (they sample from
the weights they loaded). Those are SGLang's endpoints, which ours speaks too (`server_kind=sglang`);
`server_kind=vllm` drives vLLM's own weight-update routes instead (generation/remote_vllm.py).
docs/serving.md gives the costs.

Versions: a push carries the engine's `weights_version` (set before it by whoever hands the engine
weights; SGLang's `weight_version` field), and a server that reports one (ours, SGLang:
`metadata.weight_version` in every response) must report the version pushed last: tokens sampled under
other weights (another trainer pushing to the server, a server restarted on its initial weights) are an
error naming the server and both versions, never trained on silently. Every output is stamped with that
version (`GenerationOutput.versions`). A server that reports none (vLLM) is stamped with the pushed
version, said once in the log; before this engine's first push a server samples from the weights it
loaded, which are not checked.

Stopping a call (`should_stop`, polled while its requests are in flight; partial rollouts park at a
weight push, generation/resumable.py): every server is asked to abort its requests (SGLang's
/abort_request, `abort_all`; ours speaks it), which answer with the tokens sampled so far, an unfinished
choice's finish_reason "abort"; such a response comes back cut where it stood ("length" with fewer tokens
than asked), to be resumed as a new request, re-prefilled. Every request on the server stops: give a run
servers of its own.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable
from pathlib import Path

import torch

from aligner_ext import distributed
from aligner_ext.adapters import merged_parameters, merged_state
from aligner_ext.errors import UserError
from aligner_ext.generation import remote_vllm
from aligner_ext.generation.base import ENGINES, GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.sampler import request_seed
from aligner_ext.generation.settings import RemoteEngineConfig
from aligner_ext.generation.weight_group import WeightGroup, describe
from aligner_ext.weights_file import save_state

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.05  # how often a call with `should_stop` asks it while its requests are in flight

# what a server without the weight-update endpoints of `server_kind` is told
MISSING_ENDPOINT_HINTS = {
    "sglang": "SGLang's weight-update endpoints (SGLang, aligner-ext serve); for a vLLM server set "
              "generator.remote.server_kind=vllm",
    "vllm": "vLLM's weight-update routes, which vLLM serves only with VLLM_SERVER_DEV_MODE=1 (weight_sync=disk: "
            "vLLM >= 0.16; distributed: vLLM >= 0.21 and --weight-transfer-config '{\"backend\": \"nccl\"}'); "
            "for SGLang or aligner-ext serve set generator.remote.server_kind=sglang",
}


# what to change when a server stops answering or fails a generation request, by `server_kind`
FAILED_GENERATION_HINTS = {
    "sglang": "see the server's log",
    "vllm": "see the server's log; a vLLM engine that dies on a large call needs --max-num-batched-tokens and "
            "--max-num-seqs above one request's tokens and sequences (16384 and 512 served 512 seeded prompts on the "
            "CPU), or a lower generator.remote.max_prompts_per_request",
}


class ServerError(UserError, RuntimeError):
    """A generation server failed a request after its retries, or answered something unusable."""


def answer(err: Exception) -> str:
    """What a server answered (or why it did not), on one line."""
    said = " ".join(str(err).split())
    return f"{type(err).__name__}: {said[:300]}{'...' if len(said) > 300 else ''}"


class _Server:
    """One generation server: its OpenAI client, its model id and the requests in flight."""

    def __init__(self, url: str, cfg: RemoteEngineConfig):
        import openai

        self.url = url.rstrip("/")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=cfg.api_key or "none",
                                    max_retries=cfg.max_retries, timeout=cfg.timeout_s)
        self.admin = openai.OpenAI(base_url=self.url, api_key=cfg.api_key or "none", max_retries=0, timeout=cfg.timeout_s)
        self.model = cfg.model
        self.kind = cfg.server_kind
        self.in_flight = 0

    def model_id(self) -> str:
        if self.model is None:
            self.model = self.client.models.list().data[0].id
        return self.model

    def post(self, path: str, payload: dict) -> dict:
        """A weight-update endpoint (not retried: a half-applied update is not safe to repeat); an error
        names the server and its answer."""
        return self._admin_call(path, lambda: self.admin.post(path, body=payload, cast_to=object))

    def get(self, path: str) -> dict:
        return self._admin_call(path, lambda: self.admin.get(path, cast_to=object))

    def _admin_call(self, path: str, call):
        import openai

        try:
            return call()
        except openai.NotFoundError as err:
            raise ServerError(f"generation server {self.url} has no {path} endpoint (404), which "
                              f"generator.remote.server_kind={self.kind} calls: it takes "
                              f"{MISSING_ENDPOINT_HINTS[self.kind]}") from err
        except openai.OpenAIError as err:
            raise ServerError(f"generation server {self.url}{path} failed: {answer(err)}") from err


def identical_runs(prompts: list[list[int]]) -> list[tuple[int, list[int], int]]:
    """(index of the first, prompt, count) of each run of identical consecutive prompts (a group's copies)."""
    runs: list[list] = []
    for index, prompt in enumerate(prompts):
        if runs and runs[-1][1] == prompt:
            runs[-1][2] += 1
        else:
            runs.append([index, prompt, 1])
    return [(first, prompt, count) for first, prompt, count in runs]


def request_fields(params: SamplingParams, seed: int | None) -> tuple[dict, dict]:
    """(OpenAI completions arguments, vLLM/ours extra body) for one chunk of a call."""
    standard = {"max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "stop": list(params.stop) or None, "seed": seed, "logprobs": 1 if params.return_logprobs else None}
    extra = {"return_token_ids": True, "top_k": params.top_k or -1, "stop_token_ids": list(params.stop_token_ids),
             "ignore_eos": params.ignore_eos, "skip_special_tokens": False, "include_stop_str_in_output": True}
    return standard, extra


def parse_choice(choice, server_url: str, return_logprobs: bool, stop_token_ids=()) -> GenerationOutput:
    """One OpenAI completion choice as a GenerationOutput; finish "stop" is "eos" unless a stop string or one of
    the call's `stop_token_ids` ended it (`ended_at_a_stop`)."""
    extra = choice.model_extra or {}
    token_ids = extra.get("token_ids")
    if token_ids is None:
        raise ServerError(f"generation server {server_url} returned no token ids: the remote engine needs "
                          "`return_token_ids` (our server, vLLM >= 0.10.2, SGLang)")
    if choice.finish_reason in ("length", "abort"):  # abort: cut short where it stood (module docstring)
        reason = "length"
    else:
        reason = "stop" if ended_at_a_stop(extra, stop_token_ids) else "eos"
    logprobs = None
    if return_logprobs:
        if choice.logprobs is None or choice.logprobs.token_logprobs is None:
            raise ServerError(f"generation server {server_url} returned no log-probs although they were asked for")
        logprobs = [float(value) for value in choice.logprobs.token_logprobs]
    return GenerationOutput(token_ids=list(token_ids), finish_reason=reason, logprobs=logprobs)


def ended_at_a_stop(extra: dict, stop_token_ids) -> bool:
    """Whether a choice that finished "stop" ended at a stop string or stop token id rather than at EOS. vLLM and
    ours say it in `stop_reason` (the string or id; None at EOS); SGLang in `matched_stop`, the string or the
    token id that matched, EOS's included, so an id there is a stop only if the call asked for it."""
    if extra.get("stop_reason") is not None:
        return True
    matched = extra.get("matched_stop")
    return isinstance(matched, str) or matched in stop_token_ids


@ENGINES.register("remote")
class RemoteEngine(GenerationEngine):
    """Sends each call's prompts to generation servers (module docstring)."""

    def __init__(self, model, tokenizer, cfg: RemoteEngineConfig):
        if not cfg.urls:
            raise ValueError("generator.engine=remote needs generator.remote.urls (the servers' base URLs)")
        if cfg.weight_sync == "disk" and not cfg.weight_sync_dir:
            raise ValueError("generator.remote.weight_sync=disk needs generator.remote.weight_sync_dir, "
                             "a directory the servers can read")
        if cfg.server_kind == "vllm" and cfg.weight_sync == "distributed":
            remote_vllm.check_policy_device(next(model.parameters()).device)
        self.cfg = cfg
        self.servers = [_Server(url, cfg) for url in cfg.urls]
        self._pool = ThreadPoolExecutor(max_workers=len(self.servers) * cfg.concurrency, thread_name_prefix="remote")
        # a chunk's requests of one group each (server_kind=vllm): as many samples in flight as whole chunks
        self._group_requests = ThreadPoolExecutor(
            max_workers=len(self.servers) * cfg.concurrency * cfg.max_prompts_per_request, thread_name_prefix="remote-group")
        self._lock = threading.Lock()
        self._next = itertools.cycle(range(len(self.servers)))
        self._group: WeightGroup | None = None
        self.pushed_version: int | None = None  # the version of the latest push, checked in every response
        self._unversioned: set[str] = set()  # servers said to report no version
        if cfg.weight_sync == "none":
            logger.warning("generator.remote.weight_sync=none: the servers keep sampling from the weights they "
                           "loaded; the policy's updates do not reach them")

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 should_stop: Callable[[], bool] | None = None) -> list[GenerationOutput]:
        """Continue every prompt once; a `should_stop` that turns true while the requests are in flight
        aborts them on every server, outputs cut where they stood (module docstring)."""
        size = self.cfg.max_prompts_per_request
        futures = [self._pool.submit(self._complete, prompts[begin:begin + size], params, begin)
                   for begin in range(0, len(prompts), size)]
        if should_stop is not None:
            while wait(futures, timeout=STOP_POLL_S).not_done:
                if should_stop():
                    self._on_every_server("/abort_request", lambda index: {"rid": "", "abort_all": True})
                    break
        return [output for future in futures for output in future.result()]

    def _pick(self) -> _Server:
        with self._lock:
            if self.cfg.routing == "round_robin":
                server = self.servers[next(self._next)]
            else:
                server = min(self.servers, key=lambda candidate: candidate.in_flight)
            server.in_flight += 1
            return server

    def _complete(self, chunk: list[list[int]], params: SamplingParams, first: int) -> list[GenerationOutput]:
        """The call's prompts `first`, `first` + 1, ... (`chunk`) on one server: one request, or with vLLM
        and a seeded sampling call one request per run of identical prompts (module docstring)."""
        server = self._pick()
        try:
            if self.cfg.server_kind == "vllm" and params.seed is not None and params.temperature > 0:
                requests = [self._group_requests.submit(self._request, server, [prompt], count, params, first + offset)
                            for offset, prompt, count in identical_runs(chunk)]
                return [output for request in requests for output in request.result()]
            return self._request(server, chunk, 1, params, first)
        finally:
            with self._lock:
                server.in_flight -= 1

    def _request(self, server: _Server, prompts: list[list[int]], n: int, params: SamplingParams,
                 first: int) -> list[GenerationOutput]:
        """One completions request: every prompt `n` times, seeded with the seed of the call's sample `first`."""
        import openai

        standard, extra = request_fields(params, None if params.seed is None else request_seed(params.seed, first))
        try:
            response = server.client.completions.create(model=server.model_id(), prompt=prompts, n=n, **standard,
                                                        extra_body=extra)
        except openai.OpenAIError as err:
            gone = isinstance(err, (openai.APIConnectionError, openai.InternalServerError))  # not a refused request
            raise ServerError(f"generation server {server.url} failed (retried up to {self.cfg.max_retries} times on "
                              f"connection errors, timeouts, 408/429/5xx): {answer(err)}"
                              f"{'; ' + FAILED_GENERATION_HINTS[self.cfg.server_kind] if gone else ''}") from err
        choices = sorted(response.choices, key=lambda choice: choice.index)
        if len(choices) != len(prompts) * n:
            raise ServerError(f"generation server {server.url} returned {len(choices)} choices for {len(prompts)} "
                              f"prompts x n={n}")
        outputs = [parse_choice(choice, server.url, params.return_logprobs, params.stop_token_ids) for choice in choices]
        version = self._sampled_under(server, response)
        for output in outputs:
            output.versions = [version] * len(output.token_ids)
        return outputs

    def _sampled_under(self, server: _Server, response) -> int:
        """The policy version `response`'s tokens were sampled under: the one pushed last, checked against
        the version the server reports (module docstring)."""
        if self.pushed_version is None:
            return self.weights_version
        reported = ((response.model_extra or {}).get("metadata") or {}).get("weight_version")
        if reported is None:
            if server.url not in self._unversioned:
                self._unversioned.add(server.url)
                logger.warning("generation server %s reports no weight version (vLLM, SGLang before its "
                               "weight_version): its tokens are stamped with the version pushed last, %d",
                               server.url, self.pushed_version)
            return self.pushed_version
        if str(reported) != str(self.pushed_version):
            raise ServerError(f"generation server {server.url} sampled under weight version {reported}, but this "
                              f"trainer pushed version {self.pushed_version} last: check that no other trainer "
                              "pushes weights to it (give each run servers of its own) and that it did not "
                              "restart (a restarted server samples from the weights it loaded)")
        return self.pushed_version

    def update_weights(self, policy_model) -> None:
        """Push the policy's weights, version `weights_version`, to every server (rank 0 pushes; every rank
        waits for it). A policy with LoRA adapters pushes its merged weights (`adapters.merged_state`: new
        tensors, the base untouched), which every server kind loads as it loads a full model."""
        pushing = self.cfg.weight_sync != "none"
        if pushing and distributed.is_main_process():
            with torch.no_grad():
                if self.cfg.weight_sync == "disk":
                    self._push_from_disk(policy_model)
                else:
                    self._push_distributed(policy_model)
        distributed.barrier()
        if pushing:
            self.pushed_version = self.weights_version

    def _push_from_disk(self, model) -> None:
        directory = Path(self.cfg.weight_sync_dir)
        directory.mkdir(parents=True, exist_ok=True)
        staging = directory / "model.safetensors.tmp"
        state = merged_state(model)
        save_state(remote_vllm.with_tied_copies(state) if self.cfg.server_kind == "vllm" else state, staging)
        staging.replace(directory / "model.safetensors")  # servers never read a half-written file
        if self.cfg.server_kind == "vllm":
            remote_vllm.reload_from_disk(self._on_every_server, str(directory))
        else:
            self._on_every_server("/update_weights_from_disk", lambda index: {"model_path": str(directory),
                                                                              "weight_version": str(self.weights_version)})

    def _push_distributed(self, model) -> None:
        named = merged_parameters(model)
        if self.cfg.server_kind == "vllm":
            named = remote_vllm.with_tied_names(named, merged_state(model))
        if self._group is None:
            self._group = self._join_group(next(model.parameters()).device)

        def broadcast_while(path: str, payload: dict) -> None:
            """POST `payload` to every server while rank 0 broadcasts every parameter, in order."""
            pending = self._pool.submit(self._on_every_server, path, lambda index: payload)
            for _, param in named:
                self._group.broadcast(param.detach().contiguous())
            pending.result()

        if self.cfg.server_kind == "vllm":
            remote_vllm.push(self._on_every_server, broadcast_while, named)
        else:
            names, dtypes, shapes = describe(named)
            broadcast_while("/update_weights_from_distributed",
                            {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "weight_sync",
                             "weight_version": str(self.weights_version)})

    def _join_group(self, device: torch.device):
        """The trainer's end (rank 0) of the weight group, joined with every server."""
        address = self.cfg.weight_sync_address or socket.gethostname()
        port = self.cfg.weight_sync_port or distributed.free_port()
        if self.cfg.server_kind == "vllm":
            open_rank0 = remote_vllm.nccl_rank0(device)
            offsets, world = remote_vllm.ranks([int(server.get("/get_world_size")["world_size"])
                                                for server in self.servers])
            path = "/init_weight_transfer_engine"

            def payload_for(index: int) -> dict:
                return remote_vllm.init_payload(address, port, offsets[index], world)
        else:
            backend = self.cfg.weight_sync_backend
            if backend == "auto":
                backend = "nccl" if device.type == "cuda" else "gloo"
            world = len(self.servers) + 1  # server i is rank i + 1
            path = "/init_weights_update_group"

            def payload_for(index: int) -> dict:
                return {"master_address": address, "master_port": port, "world_size": world, "backend": backend,
                        "group_name": "weight_sync", "rank_offset": index + 1}

            def open_rank0(address: str, port: int, world: int) -> WeightGroup:
                return WeightGroup(address, port, 0, world, backend)
        joining = self._pool.submit(self._on_every_server, path, payload_for)
        group = open_rank0(address, port, world)  # returns once every server has joined
        joining.result()
        return group

    def _on_every_server(self, path: str, payload_for) -> None:
        """POST `payload_for(i)` to every server i (0, 1, ...) at once."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            answers = [pool.submit(server.post, path, payload_for(index)) for index, server in enumerate(self.servers)]
            for answer in answers:
                answer.result()
