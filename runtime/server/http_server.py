"""The HTTP server: SGLang's native API (and, from openai_api.py, the OpenAI API) over one RuntimeClient."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Awaitable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.client import RequestFailed, RuntimeClient
from runtime.messages import ClientOutput, GenerateRequest

MAX_BATCH = 1024  # prompts x n in one /generate call


class HTTPError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ServerState:
    """What the endpoints share: the client, the runtime's facts, and whether all processes live."""

    def __init__(self, client: RuntimeClient, info: dict[str, Any], server_args: dict[str, Any], model_name: str) -> None:
        self.client = client
        self.info = info
        self.server_args = server_args
        self.model_name = model_name
        self.started = int(time.time())
        self.dead: str | None = None  # set by the watchdog when a runtime process dies


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="radixlm", version="0.1.0")
    app.state.runtime = state

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError) -> JSONResponse:
        return error_response(str(e), e.status)

    @app.exception_handler(RequestFailed)
    async def _refused(_: Request, e: RequestFailed) -> JSONResponse:
        return error_response(str(e), e.status)

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
    async def model_info() -> dict:
        return await state.client.control("model_info")

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {**state.server_args, **state.info, **(await state.client.control("server_info"))}

    @app.get("/debug/kv_accounting")
    async def kv_accounting() -> dict:
        """Run the scheduler's KV accounting check (tests call it after every workload)."""
        return await state.client.control("check_accounting")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        done = (await state.client.control("flush_cache"))["success"]
        if not done:
            return error_response("cannot flush the cache while requests are running", 409)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise HTTPError("abort_request needs a string 'rid'")
        await state.client.abort(rid)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await json_body(request)
        reqs, single = native_requests(body)
        if body.get("stream"):
            return await sse_response(stream_native(state.client, reqs, single))
        results = await run_until_done(request, gather_outputs(state.client, reqs))
        out = [native_result(r) for r in results]
        return JSONResponse(out[0] if single else out)

    from runtime.server.openai_api import add_openai_routes

    add_openai_routes(app, state)
    return app


def error_response(message: str, status: int = 400) -> JSONResponse:
    """Errors in OpenAI's shape on every endpoint (native ones too)."""
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


NATIVE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "rid", "messages"}


def native_requests(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
    """Expand a native /generate body into one GenerateRequest per prompt and sample (n)."""
    unknown = sorted(set(body) - NATIVE_FIELDS)
    if unknown:
        raise HTTPError(f"unknown field(s) {unknown}; allowed: {sorted(NATIVE_FIELDS)}")
    text, ids, chat = body.get("text"), body.get("input_ids"), body.get("messages")
    if sum(x is not None for x in (text, ids, chat)) != 1:
        raise HTTPError("give exactly one of 'text', 'input_ids' or 'messages'")
    if chat is not None:  # one chat conversation
        text, single, prompts = None, True, [chat]
    else:
        single = isinstance(text, str) or (ids is not None and (not ids or not isinstance(ids[0], list)))
        prompts = [text if text is not None else ids] if single else (text if text is not None else ids)
    if not isinstance(prompts, list) or not prompts:
        raise HTTPError("'text' must be a string or a non-empty list of strings; 'input_ids' a list of ints or of lists")
    params = body.get("sampling_params") or {}
    param_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(param_list) != len(prompts) or not all(isinstance(p, dict) for p in param_list):
        raise HTTPError("'sampling_params' must be an object or a list of objects, one per prompt")
    rids = body.get("rid")
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, param_list)):
        n = p.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise HTTPError("sampling_params.n must be an integer >= 1")
        base = _rid(rids, i, single)
        for j in range(n):
            rid = base if n == 1 else f"{base}-{j}"
            reqs.append(GenerateRequest(
                rid=rid,
                text=prompt if isinstance(prompt, str) else None,
                input_ids=prompt if ids is not None else None,
                messages=prompt if chat is not None else None,
                sampling_params={k: v for k, v in p.items() if k != "n"},
                return_logprob=bool(body.get("return_logprob", False)),
                logprob_start_len=_int(body, "logprob_start_len", -1),
                top_logprobs_num=_int(body, "top_logprobs_num", 0),
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                stream=bool(body.get("stream", False)),
            ))
    if len(reqs) > MAX_BATCH:
        raise HTTPError(f"{len(reqs)} generations in one call; at most {MAX_BATCH}")
    return reqs, single and len(reqs) == 1


def _rid(rids: Any, i: int, single: bool) -> str:
    if isinstance(rids, str) and single:
        return rids
    if isinstance(rids, list) and i < len(rids) and isinstance(rids[i], str):
        return rids[i]
    return uuid.uuid4().hex


def _int(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise HTTPError(f"'{key}' must be an integer")
    return value


def native_result(out: ClientOutput) -> dict[str, Any]:
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": out.meta_info}


async def gather_outputs(client: RuntimeClient, reqs: list[GenerateRequest]) -> list[ClientOutput]:
    return list(await asyncio.gather(*(client.generate(r) for r in reqs)))


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


async def stream_native(client: RuntimeClient, reqs: list[GenerateRequest], single: bool) -> AsyncIterator[bytes]:
    async for index, out in merge_streams(client, reqs):
        chunk = native_result(out)
        if not single:
            chunk["index"] = index
        yield sse(chunk)
    yield b"data: [DONE]\n\n"


async def merge_streams(client: RuntimeClient, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, ClientOutput]]:
    """Interleave the outputs of several streaming requests as they arrive, tagged by index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            async for out in client.stream(req):
                await queue.put((i, out))
        except RequestFailed as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        remaining = len(reqs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, RequestFailed):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:  # cancelling aborts requests still running (client went away)
            t.cancel()


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def sse_response(chunks: AsyncIterator[bytes]) -> Response:
    """Stream server-sent events. The first chunk is awaited here, so a refused request
    (bad input) gets a plain 4xx response instead of an event stream."""
    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except (RequestFailed, HTTPError) as e:
        return error_response(str(e), e.status)

    async def body() -> AsyncIterator[bytes]:
        yield first
        try:
            async for chunk in it:
                yield chunk
        except (RequestFailed, HTTPError) as e:
            yield sse({"error": {"message": str(e), "code": e.status}})
            yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
