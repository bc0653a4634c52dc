"""`aligner-ext serve`: one generation engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (protocol.py), GET /v1/models, /health (no
key needed) and /metrics (Prometheus text), and SGLang's weight-update endpoints:
/update_weights_from_disk (a safetensors file or a directory holding model.safetensors, written by
the trainer with aligner_ext/weights_file.py::save_weights), /init_weights_update_group and
/update_weights_from_distributed (tensors broadcast from trainer rank 0 over generation/weight_group.py).

The engine runs one call at a time: a request waits for the engine at most `request_timeout_s`
(then 503). A request's prompts x n run as one engine call, so the rollout engine batches them.
The call runs in a worker thread while the event loop watches the client: a client that disconnects
cancels its request (the engine stops between decode steps, via `should_stop`), so nobody can hold
the engine for a request whose answer nobody reads. Bounds (prompts, n, max_tokens, prompts x n x
max_tokens, body size) answer 400 / 413 naming the limit; the body is counted as it streams (chunked
bodies too, not only a Content-Length). A cancelled request answers 499 (nginx's "client closed
request"), which nobody reads. The server binds to 127.0.0.1 unless `serve.host` says otherwise;
with `serve.api_key` set every endpoint but /health wants `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from pathlib import Path

import torch
from anyio import to_thread
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from aligner_ext.config import ServeConfig
from aligner_ext.errors import ConfigError
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.weight_group import DTYPES, WeightGroup
from aligner_ext.serving.protocol import (
    ChatCompletionRequest, CompletionRequest, DiskWeightsRequest, DistributedWeightsRequest, WeightGroupRequest,
    chat_choice, completion_choice, usage,
)
from aligner_ext.weights_file import load_weights

logger = logging.getLogger(__name__)


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
        self.counters = _Counters()
        self.weight_groups: dict[str, WeightGroup] = {}
        self.weight_version = 0
        # engines that can stop mid-call (hf, rollout) take `should_stop`; others run their call to the end
        self.cancellable = "should_stop" in inspect.signature(engine.generate).parameters

    def run_engine(self, prompts: list[list[int]], params: SamplingParams, n: int,
                   cancelled: threading.Event) -> list[GenerationOutput]:
        """Every prompt n times (prompt i's samples at i*n ... i*n+n-1), in one engine call; a set
        `cancelled` (the client left) gives up the wait for the engine or stops the call."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while not self.engine_lock.acquire(timeout=0.1):
            if cancelled.is_set():
                raise HTTPException(499, "the client disconnected")
            if time.monotonic() > deadline:
                raise HTTPException(503, f"the engine stayed busy for serve.request_timeout_s={self.cfg.request_timeout_s} s")
        try:
            repeated = [prompt for prompt in prompts for _ in range(n)]
            if self.cancellable:
                return self.engine.generate(repeated, params, should_stop=cancelled.is_set)
            return self.engine.generate(repeated, params)
        finally:
            self.engine_lock.release()

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

    def completion_prompts(self, prompt) -> list[list[int]]:
        """The request's prompt(s) as token-id lists; text is tokenised as vLLM does (special tokens added)."""
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if prompt and all(isinstance(token, int) for token in prompt):
            return [list(prompt)]
        return [self.tokenizer.encode(item) if isinstance(item, str) else list(item) for item in prompt]

    def generate(self, request, prompts: list[list[int]], return_logprobs: bool, make_choice,
                 cancelled: threading.Event) -> dict:
        self.check_bounds(request, prompts)
        params = request.sampling_params(return_logprobs)
        started = time.perf_counter()
        try:
            outputs = self.run_engine(prompts, params, request.n, cancelled)
        except ValueError as err:  # the engine's check of the sampling settings
            raise HTTPException(400, str(err)) from err
        if cancelled.is_set():
            raise HTTPException(499, "the client disconnected")
        used = usage(prompts, outputs)
        self.counters.add(prompt_tokens_total=used["prompt_tokens"], generation_tokens_total=used["completion_tokens"],
                          request_seconds_total=time.perf_counter() - started)
        return {"id": f"cmpl-{time.time_ns()}", "created": int(time.time()), "model": self.cfg.model_name,
                "choices": [make_choice(index, output, params, self.tokenizer) for index, output in enumerate(outputs)],
                "usage": used}

    def load_from_disk(self, path: Path) -> None:
        file = path / "model.safetensors" if path.is_dir() else path
        if not file.is_file():
            raise HTTPException(400, f"no safetensors weights at {file}")
        with self.engine_lock:
            missing, unexpected = load_weights(self.model, file)
            if missing or unexpected:
                raise HTTPException(400, f"weights at {file} do not match the served model: missing {missing[:5]}, "
                                         f"unexpected {unexpected[:5]}")
            self.weights_changed()

    def receive_broadcast(self, request: DistributedWeightsRequest) -> None:
        group = self.weight_groups.get(request.group_name)
        if group is None:
            raise HTTPException(400, f"no weight group {request.group_name!r}: call /init_weights_update_group first")
        try:
            tensors = request.tensors()
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
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
            self.weights_changed()
        if unknown:
            raise HTTPException(400, f"{len(unknown)} tensors do not match a parameter of the served model: {unknown[:5]}")

    def weights_changed(self) -> None:
        self.engine.update_weights(self.model)
        self.weight_version += 1
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
            too_large = {"error": {"message": f"body exceeds serve.max_body_bytes={limit}", "code": 413}}
            return await JSONResponse(too_large, status_code=413)(scope, receive, send)
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()  # after the body: the client's disconnect

        async def counted(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                counters.add(request_errors_total=1)
            await send(message)

        await self.app(scope, replay, counted)


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

    def authorised(request: Request) -> None:
        if cfg.api_key is not None and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer <key>)")

    app.add_middleware(_BoundedBody, server=server)

    @app.exception_handler(HTTPException)
    async def openai_error(request: Request, err: HTTPException):
        return JSONResponse({"error": {"message": err.detail, "code": err.status_code}}, status_code=err.status_code)

    keyed = [Depends(authorised)]

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "weight_version": server.weight_version}

    @app.get("/metrics", dependencies=keyed)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.counters.prometheus() + f"aligner_ext_weight_version {server.weight_version}\n")

    @app.get("/v1/models", dependencies=keyed)
    def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "owned_by": "aligner-ext"}]}

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: CompletionRequest, raw: Request) -> dict:
        if request.logprobs is not None and request.logprobs > 1:
            raise HTTPException(400, "logprobs > 1 (top alternatives) is not served; 0 or 1 returns the sampled tokens'")

        def work(cancelled: threading.Event) -> dict:
            prompts = server.completion_prompts(request.prompt)
            return server.generate(request, prompts, request.logprobs is not None, completion_choice, cancelled)

        return {"object": "text_completion", **await _until_disconnected(raw, work)}

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> dict:
        def work(cancelled: threading.Event) -> dict:
            try:
                prompt = server.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
            except Exception as err:  # a malformed message list or a tokenizer without a chat template
                raise HTTPException(400, f"cannot render the messages with the chat template: {err}") from err
            if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
                prompt = prompt["input_ids"]
            return server.generate(request, [list(prompt)], request.logprobs, chat_choice, cancelled)

        return {"object": "chat.completion", **await _until_disconnected(raw, work)}

    @app.post("/update_weights_from_disk", dependencies=keyed)
    def update_weights_from_disk(request: DiskWeightsRequest) -> dict:
        server.load_from_disk(Path(request.model_path))
        return {"success": True, "message": f"loaded {request.model_path}", "weight_version": server.weight_version}

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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from aligner_ext.generation.base import ENGINES
    from aligner_ext.models.hf import cast_model, resolve_device, resolve_dtype
    from aligner_ext.support import check_engine
    from aligner_ext.trainer.build import generation_engine_name, model_directory

    model_dir = model_directory(cfg, Path(cfg.trainer.output_dir) / cfg.trainer.run_name)
    check_engine(cfg.generator.engine, AutoConfig.from_pretrained(model_dir))  # one line, before the weights load
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = resolve_device(cfg.policy.device)
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
