"""The HTTP server: the FastAPI app (``create_app``) with SGLang's native /generate, its control
room (admin_api.py: health, info, the debug views, adapters, weight updates), and the other APIs
(openai_api.py, responses_api.py, anthropic_api.py, tokenize_api.py, score_api.py,
embeddings_api.py), over one RuntimeClient. What the endpoints share lives apart: http_common.py
(errors, bodies, ``Guard``), sse.py, server_state.py (``ServerState``)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.runtime.client import RequestFailed, RuntimeClient
from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.native import GENERATE_BODY_SCHEMA, BadRequest, CumulativeStream, native_requests, native_result
from radixlm.runtime.reasoning import reasoning_format, split_reasoning
from radixlm.runtime.server.admin_api import add_admin_routes
from radixlm.runtime.server.http_common import (
    MAX_REQUEST_BYTES, Guard, HTTPError, error_response, internal_error, json_body, run_until_done,
)
from radixlm.runtime.server.openai_api import add_openai_routes
from radixlm.runtime.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixlm.runtime.server.responses_api import add_responses_routes
from radixlm.runtime.server.anthropic_api import add_anthropic_routes
from radixlm.runtime.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from radixlm.runtime.server.tokenize_api import DETOKENIZE_BODY, TOKENIZE_BODY, add_tokenize_routes
from radixlm.runtime.server.score_api import RerankRequest, ScoreRequest, add_score_routes
from radixlm.runtime.server.embeddings_api import ENCODE_BODY, EmbeddingRequest, add_embeddings_routes
from radixlm.runtime.server.responses_protocol import ResponsesRequest
from radixlm.runtime.server.server_state import ServerState, gather_outputs, merge_streams
from radixlm.runtime.server.sse import sse, sse_response
from radixlm.runtime.server.webui import WEBUI_PATHS, add_webui


def create_app(state: ServerState, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               webui: bool = True) -> FastAPI:
    """The app. With `api_key`, every endpoint but /health (and the page's static files, which ask
    for the key) wants `Authorization: Bearer <api_key>`; bodies over `max_request_bytes` (or
    without a length) are refused before they are read. `webui`: the page at `/`."""
    app = FastAPI(title="radixlm", version="0.1.0")
    app.state.runtime = state
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes, open_paths=WEBUI_PATHS if webui else ())
    if webui:
        add_webui(app)
    add_error_handlers(app)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await json_body(request)
        reqs, single = native_requests(body)
        if body.get("stream"):
            cumulative = not state.server_args.get("incremental_streaming_output", False)
            return await sse_response(stream_native(state.client, reqs, single, cumulative))
        results = await run_until_done(request, gather_outputs(state.client, reqs))
        out = [native_result(r) for r in results]
        return JSONResponse(out[0] if single else out)

    @app.post("/separate_reasoning")
    async def separate_reasoning(request: Request) -> dict:
        """SGLang's: a text's reasoning block and the rest, by `reasoning_parser` (default: the server's)."""
        body = await json_body(request)
        text, parser = body.get("text"), body.get("reasoning_parser", state.server_args.get("reasoning_parser"))
        if not isinstance(text, str) or not isinstance(parser, str):
            raise HTTPError("separate_reasoning needs a string 'text' and a 'reasoning_parser' "
                            "(or a server started with --reasoning-parser)")
        try:
            fmt = reasoning_format(parser)
        except ValueError as e:
            raise HTTPError(str(e)) from None
        split = split_reasoning(text, fmt, thinking=fmt.toggle is None)  # (a qwen3 text must open the block)
        return {"reasoning_text": split.reasoning, "text": split.content}

    for add_routes in (add_admin_routes, add_openai_routes, add_responses_routes, add_anthropic_routes,
                       add_tokenize_routes, add_score_routes, add_embeddings_routes):
        add_routes(app, state)
    document_bodies(app, BODIES)
    return app


# the bodies of the POST endpoints, for the OpenAPI document (`document_bodies`)
BODIES: dict[str, dict[str, Any] | type] = {
    "/generate": GENERATE_BODY_SCHEMA,
    "/abort_request": {"type": "object", "properties": {"rid": {"type": "string"}}, "required": ["rid"]},
    "/separate_reasoning": {"type": "object", "properties": {
        "text": {"type": "string"}, "reasoning_parser": {"type": "string"}}, "required": ["text"]},
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TOKENIZE_BODY,
    "/detokenize": DETOKENIZE_BODY,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/encode": ENCODE_BODY,
}


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (HTTPError, BadRequest), the runtime's refusals (with
    Retry-After when it is full), routing's (an unknown path or method) and the unexpected (a 500
    naming an error id that the log has the traceback under)."""

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> JSONResponse:
        return error_response(str(e), e.status, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        response = error_response(f"{e.detail}: {request.method} {request.url.path}", e.status_code, request.url.path)
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, e: BadRequest) -> JSONResponse:
        return error_response(str(e), 400, request.url.path)

    @app.exception_handler(RequestFailed)
    async def _refused(request: Request, e: RequestFailed) -> JSONResponse:
        response = error_response(str(e), e.status, request.url.path)
        if e.status == 503:  # full: tell clients (the OpenAI SDK among them) when to retry
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return error_response(internal_error(e, f"{request.method} {request.url.path}"), 500, request.url.path)


def document_bodies(app: FastAPI, bodies: dict[str, dict[str, Any] | type]) -> None:
    """Put the request bodies into the OpenAPI document. The endpoints parse bodies themselves (to
    answer bad input with a 400 that names the problem, in OpenAI's error shape), so FastAPI does
    not know them; a body is a JSON schema or a pydantic model."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, body in bodies.items():
                if isinstance(body, type):
                    body = body.model_json_schema(ref_template="#/components/schemas/{model}")
                body = dict(body)
                components.update(body.pop("$defs", {}))
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": body}}}
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


async def stream_native(client: RuntimeClient, reqs: list[GenerateRequest], single: bool,
                        cumulative: bool = True) -> AsyncIterator[bytes]:
    """SSE chunks in the native shape: each with everything so far (SGLang's default), or with
    only what is new."""
    streams = [CumulativeStream() for _ in reqs]
    async for index, out in merge_streams(client, reqs):
        chunk = streams[index].chunk(out) if cumulative else native_result(out)
        if not single:
            chunk["index"] = index
        yield sse(chunk)
    yield b"data: [DONE]\n\n"
