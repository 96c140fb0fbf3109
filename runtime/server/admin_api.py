"""The server's control room: health, what is served (model and server info, metrics), the debug
views, and the operations that change the runtime (flush the cache, update the weights, load and
unload LoRA adapters, abort a request). Each is one control op answered by the scheduler's
control path (scheduler/control.py), so the server keeps no state of its own about them.

Changing the adapters served reads a folder a client names on this machine's file system: off
unless the server was started with --enable-runtime-lora-updates (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING); adapters given at start (--lora-paths) are always served.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.server.http_common import HTTPError, error_response, json_body
from radixlm.runtime.server.server_state import ServerState

RUNTIME_LORA_FLAG = "--enable-runtime-lora-updates"


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
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
        out = await state.client.control("flush_cache")
        if not out["success"]:
            return error_response(out["message"], out["status"])
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
        return _reply(await state.client.control("update_weights", {"model_path": path, "abort_all_requests": abort_all}))

    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        """SGLang's and vLLM's: {lora_name, lora_path} -> a PEFT adapter served from now on."""
        body = await _lora_body(request, state, "load_lora_adapter")
        if not isinstance(body.get("lora_path"), str):
            raise HTTPError("load_lora_adapter needs 'lora_path': a PEFT adapter's folder")
        args = {"lora_name": body["lora_name"], "lora_path": body["lora_path"]}
        return _reply(await state.client.control("load_lora", args))

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        """{lora_name}: the adapter dropped (409 while requests still name it)."""
        body = await _lora_body(request, state, "unload_lora_adapter")
        return _reply(await state.client.control("unload_lora", {"lora_name": body["lora_name"]}))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise HTTPError("abort_request needs a string 'rid'")
        await state.client.abort(rid)
        return Response(status_code=200)


async def _lora_body(request: Request, state: ServerState, endpoint: str) -> dict[str, Any]:
    """The body of an adapter change, once the server allows them; it names the adapter."""
    if not state.server_args.get("enable_runtime_lora_updates"):
        raise HTTPError(f"{endpoint}: changing the LoRA adapters at run time is off on this server (a load reads "
                        f"a folder the request names): start it with {RUNTIME_LORA_FLAG}, or give the adapters "
                        "at start with --lora-paths", 403)
    body = await json_body(request)
    if not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
        raise HTTPError(f"{endpoint} needs 'lora_name': the adapter's name")
    return body


def _reply(out: dict[str, Any]) -> JSONResponse:
    """A control op's reply in SGLang's shape, {success, message}, with its status."""
    return JSONResponse({"success": out["success"], "message": out["message"]},
                        status_code=200 if out["success"] else out.get("status", 400))
