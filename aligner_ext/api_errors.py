"""OpenAI's error shape for the HTTP endpoints: `aligner-ext serve` (serving/server.py) and the agent
sessions' chat completions (agents/endpoint.py), which the trainer also serves during rollouts.

Every error answer is `{"error": {"message", "type", "param", "code"}}` (vLLM's shape too: `code` is the
HTTP status unless a named code says more, e.g. "model_not_found", "context_length_exceeded"), and a
body that is not JSON or not the endpoint's fields is a 400, not FastAPI's 422.
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(HTTPException):
    """An HTTP error with OpenAI's `code` (e.g. "model_not_found"; default: the status) and `param`."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(status, message)
        self.code, self.param = code, param


def error_response(status: int, message: str, code: str | int | None = None, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape (vLLM's too: `code` is the status unless a named code says more)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}}, status_code=status)


def shown(text: str, limit: int = 200) -> str:
    """`text` as an error message quotes it: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def answer_errors_as_openai(app: FastAPI) -> None:
    """Make every error `app` answers, its own and the router's (an unknown path, a wrong method, a body
    that does not validate), OpenAI's shape."""

    @app.exception_handler(StarletteHTTPException)
    async def openai_error(request: Request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), getattr(err, "code", None), getattr(err, "param", None))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError):
        problems = [(".".join(str(part) for part in problem["loc"] if part != "body"), problem["msg"])
                    for problem in err.errors()]
        said = "; ".join(f"{where}: {what}" if where else what for where, what in problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return error_response(400, shown(f"invalid request body: {said}{more}".replace("\n", " "), 500))
