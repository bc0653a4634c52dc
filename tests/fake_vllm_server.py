"""A stand-in for a vLLM OpenAI server's weight-update routes, built from vLLM's source (releases
0.21.0 to 0.33.0), for testing generator.remote.server_kind=vllm on a CPU.

Each route reads its request as vLLM's does, taking the strictest release where they differ:
- POST /pause (query `mode`, `clear_cache`; entrypoints/serve/rlhf/api_router.py, later
  serve/dev/rlhf/ and rl/online/api_router.py), POST /resume; while paused, completions get a 503.
- POST /collective_rpc `{"method", "args", "kwargs", "timeout"}` (serve/rpc/api_router.py, later
  serve/dev/rpc/): calls the worker's method; `reload_weights(weights_iterator=None, weights_path=None,
  is_checkpoint_format=True)` loads every *.safetensors in `weights_path` (v1/worker/gpu_model_runner.py,
  model_executor/model_loader/reload/inplace.py).
- GET /get_world_size -> `{"world_size": workers}`.
- POST /init_weight_transfer_engine `{"init_info": {...}}`, parsed as NCCLWeightTransferInitInfo(**init_info)
  (distributed/weight_transfer/nccl_engine.py, later nccl_common.py): an unknown or missing field is
  refused. Worker w joins the group as rank rank_offset + w.
- POST /start_weight_update: a JSON object body (0.21 to 0.24 parse one; later releases ignore it);
  refused while an update is active (v1/worker/gpu_worker.py).
- POST /update_weights `{"update_info": {"names", "dtype_names", "shapes"}}`, parsed as
  NCCLWeightTransferUpdateInfo(**update_info); refused before /start_weight_update. Every worker receives
  every tensor in `names` order, broadcast from rank 0, as `torch.empty(shape, dtype=getattr(torch,
  dtype_name))`, and loads it by name.
- POST /finish_weight_update (optional `{"weight_version"}`): refused without a started update.

What differs from vLLM: the weight group is gloo over generation/weight_group.py (vLLM's is NCCL over
its StatelessProcessGroup, so the tests stand in for the trainer's end too), and generation is our
engine's (serving/server.py), its answers without the weight version ours report (vLLM has none). Every
call is recorded in `calls` as (method, path, query, body).
"""

import threading
from pathlib import Path

import torch
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from safetensors.torch import load_file

from aligner_ext.generation.weight_group import WeightGroup
from aligner_ext.serving.server import build_app

SGLANG_ROUTES = {"/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed"}
INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
               "packed_buffer_size_bytes", "packed_num_buffers"}
INIT_REQUIRED = {"rank_offset", "world_size"}
UPDATE_FIELDS = {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers",
                 "is_checkpoint_format"}
UPDATE_REQUIRED = {"names", "dtype_names", "shapes"}


def parse_fields(kind: str, given: dict, allowed: set, required: set) -> dict:
    """A dataclass built from `given` (`cls(**given)`): unknown or missing fields are refused."""
    if not isinstance(given, dict):
        raise HTTPException(422, f"{kind} must be an object")
    unknown, missing = given.keys() - allowed, required - given.keys()
    if unknown or missing:
        raise HTTPException(500, f"Invalid {kind}: unexpected {sorted(unknown)}, missing {sorted(missing)}")
    return given


class FakeVllm:
    """The state behind the routes: `workers` workers, each with its weight group once initialised."""

    def __init__(self, server, workers: int = 1, dev_mode: bool = True):
        self.server, self.workers, self.dev_mode = server, workers, dev_mode
        self.calls: list[tuple[str, str, dict, object]] = []
        self.groups: list[WeightGroup] = []
        self.received: list[list[str]] = [[] for _ in range(workers)]  # names each worker received
        self.paused = False
        self.update_active = False
        generate = server.generate

        def unversioned(*args) -> dict:
            """A completion answer without our `metadata.weight_version`: vLLM reports no version."""
            return {key: value for key, value in generate(*args).items() if key != "metadata"}

        server.generate = unversioned

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        if weights_iterator is not None:
            raise HTTPException(400, "weights_iterator cannot travel over HTTP")
        files = sorted(Path(weights_path).glob("*.safetensors"))
        if not files:
            raise HTTPException(500, f"no *.safetensors in {weights_path}")
        self.load([pair for file in files for pair in load_file(str(file)).items()])

    def load(self, pairs) -> None:
        """model.load_weights: every name must be one of the model's (a KeyError in vLLM's models)."""
        state = self.server.model.state_dict()
        with self.server.engine_lock, torch.no_grad():
            for name, value in pairs:
                if name not in state:
                    raise HTTPException(500, f"KeyError: {name!r}")
                state[name].copy_(value)
            self.server.weights_changed()

    def join(self, info: dict) -> None:
        def member(worker: int) -> None:
            self.groups[worker] = WeightGroup(info["master_address"], info["master_port"], info["rank_offset"] + worker,
                                              info["world_size"], "gloo", timeout_s=30)

        self.groups = [None] * self.workers
        self.each_worker(member)

    def receive(self, info: dict) -> None:
        loaded: list[tuple[str, torch.Tensor]] = []

        def member(worker: int) -> None:
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                self.groups[worker].broadcast(weight)
                self.received[worker].append(name)
                if worker == 0:
                    loaded.append((name, weight))

        self.each_worker(member)
        self.load(loaded)

    def each_worker(self, work) -> None:
        """`work(w)` for every worker at once (each blocks in the group's collectives)."""
        errors = []

        def run(worker):
            try:
                work(worker)
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=run, args=(worker,)) for worker in range(self.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise HTTPException(500, f"worker failed: {errors[0]}")


def build_fake_vllm_app(fake: FakeVllm):
    """Our server's OpenAI routes without its SGLang weight endpoints, plus vLLM's weight routes."""
    app = build_app(fake.server)
    app.router.routes = [route for route in app.router.routes if getattr(route, "path", None) not in SGLANG_ROUTES]

    @app.middleware("http")
    async def record(request: Request, call_next):
        body = await request.body()
        fake.calls.append((request.method, request.url.path, dict(request.query_params), body))
        if fake.paused and request.url.path.startswith("/v1/completions"):
            return JSONResponse({"error": "generation is paused"}, status_code=503)
        return await call_next(request)

    if not fake.dev_mode:
        return app

    async def json_object(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as err:
            raise HTTPException(400, "Invalid JSON format") from err
        if not isinstance(body, dict):
            raise HTTPException(400, "Request body must be a JSON object")
        return body

    async def json_with(request: Request, key: str) -> dict:
        body = await json_object(request)
        if body.get(key) is None:
            raise HTTPException(400, f"Missing '{key}' in request body")
        return body

    @app.post("/pause")
    def pause(mode: str = "abort", clear_cache: bool = True) -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise HTTPException(422, f"mode {mode!r}")
        fake.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    def resume() -> dict:
        fake.paused = False
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict:
        body = await json_with(request, "method")
        method = getattr(fake, body["method"], None) if body["method"] == "reload_weights" else None
        if method is None:
            raise HTTPException(500, f"AttributeError: worker has no method {body['method']!r}")
        await run_in_threadpool(method, *body.get("args", []), **body.get("kwargs", {}))
        return {"results": [None] * fake.workers}

    @app.get("/get_world_size")
    def get_world_size() -> dict:
        return {"world_size": fake.workers}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict:
        body = await json_with(request, "init_info")
        await run_in_threadpool(fake.join, parse_fields("init_info", body["init_info"], INIT_FIELDS, INIT_REQUIRED))
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update(request: Request) -> dict:
        await json_object(request)
        if fake.update_active:
            raise HTTPException(500, "start_weight_update called while a weight update is already active")
        fake.update_active = True
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        body = await json_with(request, "update_info")
        info = parse_fields("update_info", body["update_info"], UPDATE_FIELDS, UPDATE_REQUIRED)
        if not fake.update_active:
            raise HTTPException(500, "start_weight_update must be called before update_weights.")
        if not fake.groups:
            raise HTTPException(500, "NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        await run_in_threadpool(fake.receive, info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    def finish_weight_update() -> dict:
        if not fake.update_active:
            raise HTTPException(500, "start_weight_update must be called before finish_weight_update.")
        fake.update_active = False
        return {"message": "Weight update finished"}

    return app
