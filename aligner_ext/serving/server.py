"""`aligner-ext serve`: one generation engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (protocol.py), GET /v1/models, /health (no
key needed) and /metrics (Prometheus text), and SGLang's weight-update endpoints:
/update_weights_from_disk (a directory under `serve.weights_root` holding model.safetensors, written
by the trainer with aligner_ext/weights_file.py::save_weights; refused when that setting is unset),
/init_weights_update_group and /update_weights_from_distributed (tensors broadcast from trainer rank 0
over generation/weight_group.py). An update's `weight_version` (the policy version the trainer pushed)
becomes the server's, reported by /health, the update's answer and every completion response
(`metadata.weight_version`, as SGLang's: the version its tokens were sampled under); an update without
one counts up from 0. POST /abort_request (SGLang's, `abort_all` only) stops every completion request in
flight between two decode steps: each answers with the tokens sampled so far, its unfinished choices'
finish_reason "abort" (a trainer parks them at a weight push and resumes them re-prefilled,
generation/resumable.py); a request still waiting for the engine answers with no tokens.

The engine runs one call at a time: a request waits for the engine at most `request_timeout_s`
(then 503). A request's prompts x n run as one engine call, so the rollout engine batches them.
The call runs in a worker thread while the event loop watches the client: a client that disconnects
cancels its request (the engine stops between decode steps, via `should_stop`), so nobody can hold
the engine for a request whose answer nobody reads. Bounds (prompts, n, max_tokens, prompts x n x
max_tokens, body size, prompt characters, prompt + max_tokens against the model's positions) answer
400 / 413 naming the limit, before any tokenising (characters) or generating (tokens); the body is
counted as it streams (chunked bodies too, not only a Content-Length). A cancelled request answers 499
(nginx's "client closed request"), which nobody reads. Every error is OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`; a model name other than `serve.model_name` gets
404 `model_not_found`. The server binds to 127.0.0.1 unless `serve.host` says otherwise (elsewhere it
needs `serve.api_key` or `serve.allow_unauthenticated`, config.py); with `serve.api_key` set every
endpoint but /health wants `Authorization: Bearer <key>`, compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import threading
import time
from functools import partial
from pathlib import Path

import torch
from anyio import to_thread
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from safetensors import SafetensorError, safe_open

from aligner_ext.agents.endpoint import SessionEndpoint, session_routes
from aligner_ext.agents.sessions import open_turns
from aligner_ext.agents.settings import EpisodeLimits
from aligner_ext.api_errors import ApiError, answer_errors_as_openai, error_response, shown
from aligner_ext.config import ServeConfig
from aligner_ext.errors import ConfigError
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.weight_group import DTYPES, WeightGroup
from aligner_ext.serving.protocol import (
    AbortRequest, ChatCompletionRequest, CompletionRequest, DiskWeightsRequest, DistributedWeightsRequest,
    WeightGroupRequest, chat_choice, completion_choice, usage,
)
from aligner_ext.weights_file import load_weights

logger = logging.getLogger(__name__)

CHARS_PER_POSITION = 32  # serve.max_prompt_chars unset: this many characters per position of the model
MAX_SESSIONS = 1024  # agent sessions open at once (/sessions/<session>/v1/chat/completions); DELETE frees one


def resolved_weights_root(cfg: ServeConfig) -> Path | None:
    """serve.weights_root with symlinks and `..` resolved; ConfigError unless it is a directory."""
    if cfg.weights_root is None:
        return None
    root = Path(cfg.weights_root).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"serve.weights_root={cfg.weights_root}: no such directory")
    return root


class _Counters:
    """What /metrics reports, since the server started."""

    def __init__(self):
        self.values = {"requests_total": 0, "request_errors_total": 0, "prompt_tokens_total": 0,
                       "generation_tokens_total": 0, "request_seconds_total": 0.0, "weight_updates_total": 0}
        self.lock = threading.Lock()

    def add(self, **amounts) -> None:
        with self.lock:
            for name, amount in amounts.items():
                self.values[name] += amount

    def prometheus(self) -> str:
        with self.lock:
            return "".join(f"aligner_ext_{name} {value}\n" for name, value in self.values.items())


class GenerationServer:
    """The engine, the model it samples from (for weight updates) and the state behind the endpoints."""

    def __init__(self, engine: GenerationEngine, model: torch.nn.Module, tokenizer, cfg: ServeConfig):
        self.engine, self.model, self.tokenizer, self.cfg = engine, model, tokenizer, cfg
        self.engine_lock = threading.Lock()
        self.aborts: set[threading.Event] = set()  # one per completion request in flight, set by /abort_request
        self.aborts_lock = threading.Lock()
        self.counters = _Counters()
        self.weight_groups: dict[str, WeightGroup] = {}
        self.weight_version = 0
        self.weights_root = resolved_weights_root(cfg)
        self.positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.max_prompt_chars = cfg.max_prompt_chars or (CHARS_PER_POSITION * self.positions if self.positions else None)
        # engines that can stop mid-call (hf, rollout) take `should_stop`; others run their call to the end
        self.cancellable = "should_stop" in inspect.signature(engine.generate).parameters
        self.sessions = self.session_endpoint()

    def session_endpoint(self) -> SessionEndpoint:
        """Agent sessions (agents/endpoint.py) on the engine's turn session, sampling from the policy's own
        distribution; a session's row may fill the model's positions, each turn at most serve.max_tokens."""
        length = self.positions or self.cfg.max_tokens
        params = SamplingParams(max_new_tokens=self.cfg.max_tokens, return_logprobs=True)

        async def locked_step(step):
            def run():
                with self.engine_lock:
                    return step()
            return await to_thread.run_sync(run)

        return SessionEndpoint(self.tokenizer, lambda: open_turns(self.engine, params, length, MAX_SESSIONS),
                               EpisodeLimits(max_turns=2**31, max_total_tokens=length, max_observation_tokens=length),
                               self.cfg.model_name, self.cfg.max_tokens, run_step=locked_step, open_on_request=True,
                               max_sessions=MAX_SESSIONS, max_chars=self.max_prompt_chars)

    def run_engine(self, prompts: list[list[int]], params: SamplingParams, n: int, cancelled: threading.Event,
                   aborted: threading.Event) -> tuple[list[GenerationOutput], int]:
        """Every prompt n times (prompt i's samples at i*n ... i*n+n-1), in one engine call, and the weight
        version they were sampled under (an update waits for the call); a set `cancelled` (the client left)
        gives up the wait for the engine or stops the call, a set `aborted` (/abort_request) too, the call's
        outputs cut where they are (none before the call)."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        repeated = [prompt for prompt in prompts for _ in range(n)]
        while not self.engine_lock.acquire(timeout=0.1):
            if cancelled.is_set():
                raise HTTPException(499, "the client disconnected")
            if aborted.is_set():
                return [GenerationOutput(token_ids=[], finish_reason="length") for _ in repeated], self.weight_version
            if time.monotonic() > deadline:
                raise HTTPException(503, f"the engine stayed busy for serve.request_timeout_s={self.cfg.request_timeout_s} s")
        try:
            if self.cancellable:
                stop = partial(self.stop_wanted, cancelled, aborted)
                return self.engine.generate(repeated, params, should_stop=stop), self.weight_version
            return self.engine.generate(repeated, params), self.weight_version
        finally:
            self.engine_lock.release()

    def stop_wanted(self, cancelled: threading.Event, aborted: threading.Event) -> bool:
        """Polled by the engine between two decode steps: the client left, or its request was aborted."""
        return cancelled.is_set() or aborted.is_set()

    def abort_all(self) -> int:
        """/abort_request: stop every completion request in flight (run_engine); returns how many."""
        with self.aborts_lock:
            for aborted in self.aborts:
                aborted.set()
            return len(self.aborts)

    def check_bounds(self, request, prompts: list[list[int]]) -> None:
        if request.stream:
            raise HTTPException(400, "stream=true is not served; ask without streaming")
        limits = (("prompts", len(prompts), self.cfg.max_prompts_per_request, "max_prompts_per_request"),
                  ("n", request.n, self.cfg.max_n, "max_n"), ("max_tokens", request.max_tokens, self.cfg.max_tokens, "max_tokens"),
                  ("prompts x n x max_tokens", len(prompts) * request.n * request.max_tokens,
                   self.cfg.max_tokens_per_request, "max_tokens_per_request"))
        for what, value, limit, key in limits:
            if value > limit:
                raise HTTPException(400, f"{what}={value} exceeds serve.{key}={limit}")
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise HTTPException(400, "every prompt needs at least one token")
        vocab = len(self.tokenizer)
        if any(not 0 <= token < vocab for prompt in prompts for token in prompt):
            raise HTTPException(400, f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= token < vocab for token in request.stop_token_ids or []):
            raise HTTPException(400, f"stop_token_ids must be in [0, {vocab})")
        longest = max(len(prompt) for prompt in prompts)
        if self.positions is not None and longest + request.max_tokens > self.positions:
            raise HTTPException(400, f"prompt of {longest} tokens + max_tokens={request.max_tokens} = "
                                     f"{longest + request.max_tokens} exceeds the model's {self.positions} positions")

    def check_model(self, name: str | None) -> None:
        """OpenAI's 404 for a model this server does not serve (no name: the served one)."""
        if name is not None and name != self.cfg.model_name:
            raise ApiError(404, f"The model `{shown(name)}` does not exist; this server serves "
                                f"`{self.cfg.model_name}`", code="model_not_found", param="model")

    def check_chars(self, sizes: list[int]) -> None:
        """Refuse a prompt of more characters (`sizes`: each text prompt's) than the cap, before tokenising."""
        size = max(sizes, default=0)
        if self.max_prompt_chars is not None and size > self.max_prompt_chars:
            source = (f"serve.max_prompt_chars={self.max_prompt_chars}" if self.cfg.max_prompt_chars else
                      f"{self.max_prompt_chars} (serve.max_prompt_chars unset: {CHARS_PER_POSITION} per position "
                      f"of the model's {self.positions})")
            raise HTTPException(400, f"prompt of {size} characters exceeds {source}")

    def completion_prompts(self, prompt) -> list[list[int]]:
        """The request's prompt(s) as token-id lists; text is tokenised as vLLM does (special tokens added)."""
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if prompt and all(isinstance(token, int) for token in prompt):
            return [list(prompt)]
        return [self.encode(item) if isinstance(item, str) else list(item) for item in prompt]

    def encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except (TypeError, ValueError, UnicodeError) as err:  # e.g. a lone surrogate the tokenizer cannot take
            raise HTTPException(400, f"cannot tokenise the prompt (is it valid Unicode?): {err}") from err

    def generate(self, request, prompts: list[list[int]], return_logprobs: bool, make_choice,
                 cancelled: threading.Event) -> dict:
        self.check_bounds(request, prompts)
        params = request.sampling_params(return_logprobs)
        started, aborted = time.perf_counter(), threading.Event()
        with self.aborts_lock:
            self.aborts.add(aborted)
        try:
            outputs, version = self.run_engine(prompts, params, request.n, cancelled, aborted)
        except ValueError as err:  # the engine's check of the sampling settings
            raise HTTPException(400, str(err)) from err
        finally:
            with self.aborts_lock:
                self.aborts.discard(aborted)
        if cancelled.is_set():
            raise HTTPException(499, "the client disconnected")
        used = usage(prompts, outputs)
        self.counters.add(prompt_tokens_total=used["prompt_tokens"], generation_tokens_total=used["completion_tokens"],
                          request_seconds_total=time.perf_counter() - started)
        choices = [make_choice(index, output, params, self.tokenizer) for index, output in enumerate(outputs)]
        if aborted.is_set():  # cut short: SGLang's finish_reason for an aborted request
            for choice, output in zip(choices, outputs):
                if output.finish_reason == "length" and len(output.token_ids) < params.max_new_tokens:
                    choice["finish_reason"] = "abort"
        return {"id": f"cmpl-{time.time_ns()}", "created": int(time.time()), "model": self.cfg.model_name,
                "choices": choices, "usage": used, "metadata": {"weight_version": str(version)}}

    def weights_file(self, model_path: str) -> Path:
        """The model.safetensors of `model_path`, a directory under serve.weights_root (symlinks and `..`
        resolved, the file's own link too); 403 outside the root or with none set, 400 for anything else."""
        if self.weights_root is None:
            raise HTTPException(403, "updates from disk are off: start the server with serve.weights_root=<a "
                                     "directory> to load weight directories under it")
        quoted = shown(model_path)
        try:
            path = Path(model_path).resolve()
            file = (path / "model.safetensors").resolve()
        except (OSError, RuntimeError, ValueError) as err:  # a null byte, a name too long, a symlink loop
            raise HTTPException(400, f"model_path {quoted!r} is not a usable path: {err}") from err
        if not (path.is_relative_to(self.weights_root) and file.is_relative_to(self.weights_root)):
            raise HTTPException(403, f"model_path {quoted!r} is outside serve.weights_root={self.weights_root}")
        if not path.is_dir():
            raise HTTPException(400, f"model_path {quoted!r} is not a directory: give the directory holding model.safetensors")
        if not file.is_file():
            raise HTTPException(400, f"model_path {quoted!r} holds no model.safetensors")
        return file

    def load_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Load the weights of `model_path` (weights_file) in place, once their names and shapes (the
        file's header) are known to fit the served model; `version`: theirs (weights_changed)."""
        file = self.weights_file(model_path)
        state = self.model.state_dict()
        try:
            with safe_open(str(file), framework="pt") as weights:
                shapes = {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118 (not a dict)
        except (SafetensorError, OSError) as err:
            raise HTTPException(400, f"{file} is not a readable safetensors file: {err}") from err
        wrong = [name for name, shape in shapes.items() if name not in state or list(state[name].shape) != shape]
        if wrong:
            raise HTTPException(400, f"weights at {file} do not match the served model: {len(wrong)} tensors of "
                                     f"unknown names or shapes, e.g. {wrong[:5]}")
        with self.engine_lock:
            try:
                missing, unexpected = load_weights(self.model, file)
            except (SafetensorError, OSError, RuntimeError) as err:
                raise HTTPException(400, f"cannot load {file}: {err}") from err
            if missing or unexpected:
                raise HTTPException(400, f"weights at {file} do not match the served model: missing {missing[:5]}, "
                                         f"unexpected {unexpected[:5]}")
            self.weights_changed(version)

    def receive_broadcast(self, request: DistributedWeightsRequest) -> None:
        group = self.weight_groups.get(request.group_name)
        if group is None:
            raise HTTPException(400, f"no weight group {request.group_name!r}: call /init_weights_update_group first")
        try:
            tensors = request.tensors()
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        for name, dtype, shape in tensors:  # before anything is received: a bad entry would break the broadcast
            if dtype not in DTYPES or any(size < 0 for size in shape):
                raise HTTPException(400, f"tensor {shown(name)!r}: dtype {shown(dtype)!r} (one of {sorted(DTYPES)}) "
                                         f"and shape {shape[:8]} (sizes >= 0) cannot be received")
        params = dict(self.model.named_parameters())
        device = next(self.model.parameters()).device
        unknown = []
        with self.engine_lock, torch.no_grad():
            for name, dtype, shape in tensors:  # receive every tensor, known or not: the sender broadcasts them all
                received = torch.empty(shape, dtype=DTYPES[dtype], device=device)
                group.broadcast(received)
                if name in params and params[name].shape == received.shape:
                    params[name].data.copy_(received)
                else:
                    unknown.append(name)
            self.weights_changed(request.weight_version)
        if unknown:
            raise HTTPException(400, f"{len(unknown)} tensors do not match a parameter of the served model: {unknown[:5]}")

    def weights_changed(self, version: int | None = None) -> None:
        """After an update: the weights' `version`, the policy version the trainer pushed (reported in
        /health and every response), or with none given the count of updates."""
        self.engine.update_weights(self.model)
        self.sessions.weights_changed()
        self.weight_version = self.weight_version + 1 if version is None else version
        self.counters.add(weight_updates_total=1)


class _BoundedBody:
    """ASGI middleware: reads the body before the app sees it, counting bytes as they arrive (a chunked
    body has no Content-Length to check), answers 413 once it passes serve.max_body_bytes, else replays
    it to the app; counts requests and error answers for /metrics."""

    def __init__(self, app, server: GenerationServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, counters = self.server.cfg.max_body_bytes, self.server.counters
        counters.add(requests_total=1)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        size = int(declared) if declared.isdigit() else 0  # a declared size past the limit answers at once
        chunks, received, more = [], 0, True
        while more and max(size, received) <= limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            more = message.get("more_body", False)
        if max(size, received) > limit:
            counters.add(request_errors_total=1)
            return await error_response(413, f"body exceeds serve.max_body_bytes={limit}")(scope, receive, send)
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()  # after the body: the client's disconnect

        async def counted(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                counters.add(request_errors_total=1)
            await send(message)

        await self.app(scope, replay, counted)


def _strings(value) -> list[str]:
    """Every string in a JSON value (a chat request's messages: contents, parts, names)."""
    found, pending = [], [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


async def _until_disconnected(raw: Request, work) -> dict:
    """`work(cancelled)` in a worker thread, the event loop meanwhile watching the client: one that
    disconnects sets `cancelled`, which stops the engine between decode steps and frees it."""
    cancelled = threading.Event()
    task = asyncio.ensure_future(to_thread.run_sync(work, cancelled))
    try:
        while not task.done():
            if await raw.is_disconnected():
                cancelled.set()
            await asyncio.wait({task}, timeout=0.1)
        return task.result()
    finally:
        cancelled.set()  # this coroutine itself cancelled (server shutdown): stop the engine too


def build_app(server: GenerationServer) -> FastAPI:
    """The HTTP endpoints over `server` (module docstring)."""
    cfg = server.cfg
    app = FastAPI(title="aligner-ext generation server")

    expected_key = None if cfg.api_key is None else f"Bearer {cfg.api_key}".encode()

    def authorised(request: Request) -> None:
        if expected_key is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1")  # the header's bytes, as sent
        if not hmac.compare_digest(given, expected_key):
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer <key>)")

    app.add_middleware(_BoundedBody, server=server)

    answer_errors_as_openai(app)

    keyed = [Depends(authorised)]

    # the cheap GET endpoints run on the event loop, so they answer while every worker thread waits for the engine
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "weight_version": server.weight_version}

    @app.get("/metrics", dependencies=keyed)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.counters.prometheus() + f"aligner_ext_weight_version {server.weight_version}\n")

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "owned_by": "aligner-ext"}]}

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: CompletionRequest, raw: Request) -> dict:
        server.check_model(request.model)
        if request.logprobs is not None and request.logprobs > 1:
            raise HTTPException(400, "logprobs > 1 (top alternatives) is not served; 0 or 1 returns the sampled tokens'")
        items = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        server.check_chars([len(item) for item in items if isinstance(item, str)])

        def work(cancelled: threading.Event) -> dict:
            prompts = server.completion_prompts(request.prompt)
            return server.generate(request, prompts, request.logprobs is not None, completion_choice, cancelled)

        return {"object": "text_completion", **await _until_disconnected(raw, work)}

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> dict:
        server.check_model(request.model)
        server.check_chars([sum(len(text) for text in _strings(request.messages))])  # the messages make one prompt

        def work(cancelled: threading.Event) -> dict:
            try:
                prompt = server.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
            except Exception as err:  # a malformed message list or a tokenizer without a chat template
                raise HTTPException(400, f"cannot render the messages with the chat template: {err}") from err
            if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
                prompt = prompt["input_ids"]
            return server.generate(request, [list(prompt)], request.logprobs, chat_choice, cancelled)

        return {"object": "chat.completion", **await _until_disconnected(raw, work)}

    app.include_router(session_routes(server.sessions, keyed))

    @app.post("/update_weights_from_disk", dependencies=keyed)
    def update_weights_from_disk(request: DiskWeightsRequest) -> dict:
        server.load_from_disk(request.model_path, request.weight_version)
        return {"success": True, "message": f"loaded {request.model_path}", "weight_version": server.weight_version}

    @app.post("/abort_request", dependencies=keyed)
    def abort_request(request: AbortRequest) -> dict:
        if not request.abort_all:
            raise HTTPException(400, "only abort_all=true is served: every completion request in flight stops")
        return {"success": True, "aborted": server.abort_all()}

    @app.post("/init_weights_update_group", dependencies=keyed)
    def init_weights_update_group(request: WeightGroupRequest) -> dict:
        try:
            server.weight_groups[request.group_name] = WeightGroup(
                request.master_address, request.master_port, request.rank_offset, request.world_size,
                request.backend, request.group_name)
        except (RuntimeError, ValueError) as err:
            raise HTTPException(400, f"cannot join weight group {request.group_name!r}: {err}") from err
        return {"success": True, "message": f"joined {request.group_name!r} as rank {request.rank_offset}"}

    @app.post("/update_weights_from_distributed", dependencies=keyed)
    def update_weights_from_distributed(request: DistributedWeightsRequest) -> dict:
        server.receive_broadcast(request)
        return {"success": True, "message": "weights updated", "weight_version": server.weight_version}

    return app


def build_server(cfg) -> GenerationServer:
    """The configured model (the embedded one when model.path is unset, built in the run directory as
    `train` builds it) and engine, as a GenerationServer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from aligner_ext.data.tokenizer import load_tokenizer
    from aligner_ext.generation.base import ENGINES
    from aligner_ext.models.hf import cast_model, resolve_device, resolve_dtype
    from aligner_ext.models.kernels import prepare_gpu_process
    from aligner_ext.support import check_engine
    from aligner_ext.trainer.build import generation_engine_name, model_directory

    resolved_weights_root(cfg.serve)  # a missing directory is refused before the model loads
    model_dir = model_directory(cfg, Path(cfg.trainer.output_dir) / cfg.trainer.run_name)
    check_engine(cfg.generator.engine, AutoConfig.from_pretrained(model_dir))  # one line, before the weights load
    tokenizer = load_tokenizer(model_dir)
    device = resolve_device(cfg.policy.device)
    if device.type == "cuda":
        prepare_gpu_process(cfg.policy.cudnn_attention)
    model = cast_model(AutoModelForCausalLM.from_pretrained(model_dir), device, resolve_dtype(cfg.policy.dtype, device))
    model.eval()
    name = generation_engine_name(cfg, model.config, device)
    if name == "remote":
        raise ConfigError("generator.engine=remote cannot be served: choose the engine the server runs (hf, rollout, auto)")
    logger.info("serving %s with the %s engine", model_dir, name)
    return GenerationServer(ENGINES.get(name)(model, tokenizer, getattr(cfg.generator, name)), model, tokenizer, cfg.serve)


def serve(cfg) -> None:
    """Serve the configured model and engine on serve.host:serve.port until interrupted."""
    import uvicorn

    server = build_server(cfg)
    logger.info("listening on http://%s:%d", cfg.serve.host, cfg.serve.port)
    uvicorn.run(build_app(server), host=cfg.serve.host, port=cfg.serve.port, log_level=cfg.serve.log_level)
