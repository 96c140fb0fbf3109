"""The HTTP server: the FastAPI app (``create_app``) with SGLang's native API (and, from openai_api.py
and responses_api.py, the OpenAI API) over one RuntimeClient. What the endpoints share lives
apart: http_common.py (errors, bodies, ``Guard``), sse.py, server_state.py (``ServerState``)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.runtime.client import RequestFailed, RuntimeClient
from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.native import GENERATE_BODY_SCHEMA, BadRequest, CumulativeStream, native_requests, native_result
from radixlm.runtime.reasoning import reasoning_format, split_reasoning
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

log = logging.getLogger("radixlm.http")


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

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> JSONResponse:
        return error_response(str(e), e.status, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """An unknown path (404) or method (405), in OpenAI's error shape as every other error."""
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

    @app.get("/health")
    async def health() -> Response:
        if state.dead:
            return error_response(f"runtime unhealthy: {state.dead}", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state.dead:
            return error_response(f"runtime unhealthy: {state.dead}", 503)
        req = GenerateRequest(f"health-{uuid.uuid4().hex}", input_ids=[0], sampling_params={"max_new_tokens": 1})
        await asyncio.wait_for(state.client.generate(req), timeout=60)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer names
    async def model_info() -> dict:
        return await state.client.control("model_info")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return {**state.server_args, **state.info, **(await state.client.control("server_info"))}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render(await state.client.control("server_info"))
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/debug/kv_accounting")
    async def kv_accounting() -> dict:
        """Run the scheduler's KV accounting check (tests call it after every workload)."""
        return await state.client.control("check_accounting")

    @app.get("/debug/dashboard")
    async def dashboard(since: float | None = None) -> dict:
        """The live view's numbers, taken now: queues, the latest step, tokens/s, KV pages by state,
        the step log after `since` (the `now` of an earlier answer), the radix tree's largest
        prefixes, the cache hit rate of finished requests and their latency histograms."""
        view = await state.client.control("dashboard", {"since": since})
        return {**view, "cache_hit_rate": state.metrics.hit_rate, "histograms": state.metrics.latency_histograms()}

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        done = (await state.client.control("flush_cache"))["success"]
        if not done:
            return error_response("cannot flush the cache while requests are running", 409)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        """SGLang's: serve a checkpoint of the same model (`model_path`) from now on. Running requests
        finish on the old weights (or, with `abort_all_requests`, are aborted) while new ones wait;
        then the weights are swapped and the prefix cache flushed. Answers in SGLang's shape,
        {success, message}, 400 for a checkpoint that cannot replace the served one."""
        body = await json_body(request)
        path, load_format, abort_all = body.get("model_path"), body.get("load_format"), body.get("abort_all_requests", False)
        if not isinstance(path, str) or not path:
            raise HTTPError("update_weights_from_disk needs 'model_path': a HF checkpoint directory or a .gguf file")
        if load_format not in (None, "auto"):
            raise HTTPError(f"load_format {load_format!r} is not supported: leave it out (or 'auto')")
        if not isinstance(abort_all, bool):
            raise HTTPError("'abort_all_requests' must be true or false")
        out = await state.client.control("update_weights", {"model_path": path, "abort_all_requests": abort_all})
        return JSONResponse({"success": out["success"], "message": out["message"]},
                            status_code=200 if out["success"] else out.get("status", 400))

    async def lora_op(request: Request, op: str) -> JSONResponse:
        body = await json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise HTTPError(f"{op.replace('_', ' ')} needs 'lora_name': the adapter's name")
        args = {"lora_name": name}
        if op == "load_lora":
            if not isinstance(body.get("lora_path"), str):
                raise HTTPError("load_lora_adapter needs 'lora_path': a PEFT adapter's folder")
            args["lora_path"] = body["lora_path"]
        out = await state.client.control(op, args)
        if out["success"]:  # the OpenAI API's `model` names it (or no longer)
            if op == "load_lora":
                state.loras[name] = args["lora_path"]
            else:
                state.loras.pop(name, None)
        return JSONResponse({"success": out["success"], "message": out["message"]},
                            status_code=200 if out["success"] else out.get("status", 400))

    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        """SGLang's and vLLM's: {lora_name, lora_path} -> a PEFT adapter served from now on."""
        return await lora_op(request, "load_lora")

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        """{lora_name}: the adapter dropped (409 while requests still name it)."""
        return await lora_op(request, "unload_lora")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise HTTPError("abort_request needs a string 'rid'")
        await state.client.abort(rid)
        return Response(status_code=200)

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

    add_openai_routes(app, state)
    add_responses_routes(app, state)
    add_anthropic_routes(app, state)
    add_tokenize_routes(app, state)
    add_score_routes(app, state)
    add_embeddings_routes(app, state)
    document_bodies(app, {
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
    })
    return app


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
