"""HTTP plumbing that every front shares (the server's app and the router's): errors in OpenAI's
shape (``HTTPError``, ``error_response``), reading a JSON object body (``json_body``), awaiting
work until the HTTP client disconnects (``run_until_done``), and the ``Guard`` middleware in front
of every endpoint (API key, body size limit up to ``MAX_REQUEST_BYTES``). Knows nothing of the
runtime.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from typing import Any, Awaitable

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse


class HTTPError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def internal_error(e: BaseException, where: str) -> str:
    """Log an unexpected exception with a fresh error id; the message that tells the client that id."""
    error_id = uuid.uuid4().hex[:12]
    logging.getLogger("radixlm.http").error("%s failed (error id %s)", where, error_id, exc_info=e)
    return f"internal server error (error id {error_id})"


# Largest request body accepted (bytes): a full context of text is far below this.
MAX_REQUEST_BYTES = 32 << 20


class Guard:
    """ASGI middleware in front of every endpoint: the API key, then the body size. Plain ASGI
    (not a Starlette BaseHTTPMiddleware), so streams and disconnects pass through untouched."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int,
                 open_paths: tuple[str, ...] = ()) -> None:
        """`open_paths`: paths served without the key, as /health is (one ending in `/*` covers
        everything under it): the web page's files, which then ask for the key themselves."""
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.open_paths = ("/health", *open_paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await error_response(*refusal, path=scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _open(self, path: str) -> bool:
        return any(path == p or (p.endswith("/*") and path.startswith(p[:-1])) for p in self.open_paths)

    def _refusal(self, scope: dict) -> tuple[str, int] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and not self._open(scope["path"]):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
                token = headers.get("x-api-key", "")
            if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return "missing or wrong API key: send the header 'Authorization: Bearer <key>' (or x-api-key)", 401
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get("content-length")
            if length is None:
                return "a request body needs a Content-Length header", 411
            if not length.isdigit():
                return f"bad Content-Length {length!r}", 400
            if int(length) > self.max_request_bytes:
                return f"request body of {length} bytes is over the limit of {self.max_request_bytes} bytes", 413
        return None


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's Messages API: its own error shape
SGLANG_PATHS = ("/v1/score",)  # SGLang's own endpoints: SGLang's error object


def error_response(message: str, status: int = 400, path: str = "") -> JSONResponse:
    """Errors in OpenAI's shape on every endpoint (native ones too), but in Anthropic's under
    `ANTHROPIC_PATHS` and SGLang's under `SGLANG_PATHS` (`path`: the request's)."""
    if path.startswith(ANTHROPIC_PATHS):
        from radixlm.runtime.server.anthropic_protocol import error_body

        return JSONResponse(error_body(message, status), status_code=status)
    if path in SGLANG_PATHS:  # SGLang's ErrorResponse: the object itself, not under "error"
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        return JSONResponse({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                            status_code=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise HTTPError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError("the body must be a JSON object")
    return body


async def run_until_done(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (which aborts its requests) if the HTTP client disconnects."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise HTTPError("client disconnected", 499)
