"""A generation server (aligner_ext/serving) on a free local port, in a thread, for the tests."""

import threading
import time
from contextlib import contextmanager

import uvicorn

from aligner_ext.distributed import free_port
from aligner_ext.serving.server import GenerationServer, ServeConfig, build_app


@contextmanager
def serve_in_thread(server: GenerationServer, app=None):
    """Yield the base URL of `server` (or of `app`, routes over it) listening on 127.0.0.1; stop it on exit."""
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(app or build_app(server), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        http.should_exit = True
        thread.join(timeout=30)


def serving(engine, model, tokenizer, **settings) -> GenerationServer:
    """A GenerationServer over `engine`, which samples from `model`."""
    return GenerationServer(engine, model, tokenizer, ServeConfig(**settings))
