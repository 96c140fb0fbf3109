"""`radixlm router`: data parallelism. One HTTP front (the native and OpenAI APIs) over several
runtime replicas, each request sent where its prefix is most likely cached.

Cache-aware routing: the router keeps a PrefixTree per replica of the request texts it sent there.
A request goes to the replica with the longest match when that match covers at least
`cache_threshold` of its text; otherwise to the least loaded replica (which then learns the
prefix). When load is lopsided (the busiest replica has more than `balance_abs` requests over
the idlest and more than `balance_rel` times as many), the least loaded replica wins regardless.
`round_robin` is there to compare against.

Replicas are health-checked every `health_interval` seconds; one that fails a check or refuses a
connection is taken out until it answers again. A request whose replica failed before answering
(a connection error, or a 5xx before any byte of a stream) is retried on another.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.runtime.router import POLICIES
from radixlm.runtime.router.prefix_tree import PrefixTree
from radixlm.runtime.server.http_common import (
    MAX_REQUEST_BYTES, Guard, HTTPError, error_response, json_body, run_until_done,
)

log = logging.getLogger("radixlm.router")


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    tree: PrefixTree = field(default_factory=PrefixTree)


class NoReplica(RuntimeError):
    pass


class Router:
    def __init__(self, urls: list[str], policy: str = "cache_aware", cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.5, health_interval: float = 2.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.policy = policy
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.health_interval = health_interval
        self._turn = itertools.count()

    def pick(self, key: str, exclude: set[str] = frozenset()) -> Replica:
        """The replica for a request whose routing text is `key` (and remember it went there)."""
        live = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not live:
            raise NoReplica("no healthy replica")
        if self.policy == "round_robin":
            return live[next(self._turn) % len(live)]
        idlest = min(live, key=lambda r: (r.in_flight, r.tree.chars))  # ties: the one remembering least
        busiest = max(live, key=lambda r: r.in_flight)
        lopsided = (busiest.in_flight - idlest.in_flight > self.balance_abs
                    and busiest.in_flight > self.balance_rel * idlest.in_flight)
        chosen = idlest
        if not lopsided and key:
            best, matched = max(((r, r.tree.match(key)) for r in live), key=lambda rm: (rm[1], -rm[0].in_flight))
            if matched >= self.cache_threshold * len(key):
                chosen = best
        chosen.tree.insert(key)
        return chosen

    async def check_health(self, client: httpx.AsyncClient) -> None:
        async def one(r: Replica) -> None:
            try:
                ok = (await client.get(r.url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok != r.healthy:
                log.warning("replica %s is %s", r.url, "back" if ok else "down: taken out")
            r.healthy = ok

        await asyncio.gather(*(one(r) for r in self.replicas))


def routing_key(path: str, body: dict[str, Any]) -> str:
    """The text whose prefix decides the replica: the prompt, the token ids, or the messages."""
    if path == "/v1/responses":  # the instructions, then the input (a string or items)
        items = body.get("input")
        text = items if isinstance(items, str) else "".join(
            f"{i.get('role')}\x00{i.get('content')}\x00" for i in items or [] if isinstance(i, dict))
        return f"{body.get('instructions') or ''}\x00{text}"
    if path == "/v1/chat/completions" or "messages" in body:
        return "".join(f"{m.get('role')}\x00{m.get('content')}\x00" for m in body.get("messages") or []
                       if isinstance(m, dict))
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("text", body.get("input_ids"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch goes where its first prompt goes
    if isinstance(prompt, list):
        return ",".join(map(str, prompt)) + ","  # token ids, cut only at token boundaries
    return prompt if isinstance(prompt, str) else ""


def create_router_app(router: Router, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The router's app; `api_key` and `max_request_bytes` guard it as they guard `radixlm serve`."""
    app = FastAPI(title="radixlm router", version="0.1.0")
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def health_loop() -> None:
        while True:
            await router.check_health(client)
            await asyncio.sleep(router.health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        await client.aclose()

    app.router.lifespan_context = lifespan

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(r.healthy for r in router.replicas) else 503)

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {"policy": router.policy, "replicas": [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "served": r.served,
             "tree_chars": r.tree.chars} for r in router.replicas]}

    @app.get("/v1/models")
    async def models() -> Response:
        return await _forward_get(client, router, "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        return await _forward_get(client, router, f"/v1/models/{model}")

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return await _forward_get(client, router, "/get_model_info")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        results = await asyncio.gather(*(client.post(r.url + "/flush_cache") for r in router.replicas
                                         if r.healthy), return_exceptions=True)
        ok = all(isinstance(x, httpx.Response) and x.status_code == 200 for x in results)
        return Response(status_code=200 if ok else 409)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        """Every replica serves the new weights (each waits for its own running requests)."""
        body = await request.body()
        results = await asyncio.gather(*(client.post(r.url + "/update_weights_from_disk", content=body,
                                                     headers={"content-type": "application/json"}, timeout=None)
                                         for r in router.replicas if r.healthy), return_exceptions=True)
        failed = [x.text if isinstance(x, httpx.Response) else f"{type(x).__name__}: {x}"
                  for x in results if not isinstance(x, httpx.Response) or x.status_code != 200]
        if failed:
            status = max((x.status_code for x in results if isinstance(x, httpx.Response) and x.status_code != 200),
                         default=502)
            return JSONResponse({"success": False, "message": "; ".join(failed)}, status_code=status)
        return JSONResponse({"success": True, "message": f"{len(results)} replicas updated"})

    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, _proxy_endpoint(client, router, path), methods=["POST"])
    return app


def _proxy_endpoint(client: httpx.AsyncClient, router: Router, path: str):
    async def endpoint(request: Request) -> Response:
        try:  # the body is checked here only as far as routing needs; the replica checks the rest
            body = await json_body(request)
            return await _dispatch(request, client, router, path, await request.body(), routing_key(path, body),
                                   bool(body.get("stream")))
        except HTTPError as e:  # not JSON, or the client went away while waiting
            return error_response(str(e), e.status)

    return endpoint


async def _dispatch(request: Request, client: httpx.AsyncClient, router: Router, path: str, raw: bytes, key: str,
                    stream: bool) -> Response:
    tried: set[str] = set()
    while True:
        try:
            replica = router.pick(key, tried)
        except NoReplica:
            return error_response("no replica could take the request", 503)
        tried.add(replica.url)
        replica.in_flight += 1
        req = client.build_request("POST", replica.url + path, content=raw,
                                   headers={"content-type": "application/json"})
        try:
            upstream = await client.send(req, stream=True)
        except httpx.TransportError as e:
            replica.in_flight -= 1
            replica.healthy = False  # until the next health check says otherwise
            log.warning("replica %s failed (%s); retrying elsewhere", replica.url, e)
            continue
        if upstream.status_code >= 500 and len(tried) < len(router.replicas):
            await upstream.aclose()
            replica.in_flight -= 1
            continue
        replica.served += 1
        if not stream:
            try:  # a client that leaves closes the replica's connection too, which aborts the request there
                content = await run_until_done(request, upstream.aread())
            finally:
                await upstream.aclose()
                replica.in_flight -= 1
            return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
        return StreamingResponse(_relay(upstream, replica), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))


async def _relay(upstream: httpx.Response, replica: Replica) -> AsyncIterator[bytes]:
    """Pass a stream through; closing it (the client left) closes the replica's stream, which aborts
    the request there."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        replica.in_flight -= 1


async def _forward_get(client: httpx.AsyncClient, router: Router, path: str) -> Response:
    for r in router.replicas:
        if r.healthy:
            try:
                up = await client.get(r.url + path, timeout=10)
                return Response(up.content, up.status_code, media_type=up.headers.get("content-type"))
            except httpx.HTTPError:
                continue
    return error_response("no replica could take the request", 503)
