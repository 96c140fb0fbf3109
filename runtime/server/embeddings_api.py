"""Embeddings from the decoder models we serve: ``POST /v1/embeddings`` (OpenAI's shape) and SGLang's
native ``POST /encode``.

Each input is a prefill-only request whose prompt's final hidden states (after the model's last
norm) are pooled: the last token's (`pooling` "last", the default: Qwen3-Embedding's and
e5-mistral's), or the mean of every token's ("mean": those requests compute the whole prompt, the
radix cache skipped). The vector is L2-normalized unless `normalize` is false; OpenAI's
`dimensions` keeps its first dimensions and normalizes again (Matryoshka); `encoding_format`
"base64" sends the little-endian float32 bytes. No decode step runs and no KV is kept beyond
what the radix cache holds.
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.server.http_common import HTTPError, json_body, run_until_done
from radixlm.runtime.server.openai_api import parse_request
from radixlm.runtime.server.server_state import ServerState, gather_outputs

MAX_INPUTS = 2048
POOLINGS = ("last", "mean")
ENCODE_BODY = {"type": "object", "properties": {
    "text": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "input_ids": {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                            {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]},
    "pooling": {"enum": list(POOLINGS)}, "normalize": {"type": "boolean"}}}


class EmbeddingRequest(BaseModel):
    """Body of ``POST /v1/embeddings``; `pooling` and `normalize` are ours (OpenAI's API has neither)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: str = "float"
    user: str | None = None  # accepted, no effect
    pooling: str = "last"
    normalize: bool = True


def add_embeddings_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = parse_request(EmbeddingRequest, await json_body(request))
        if req.encoding_format not in ("float", "base64"):
            raise HTTPError(f"encoding_format must be float or base64, not {req.encoding_format!r}")
        inputs = _inputs(req.input)
        outs = await run_until_done(request, _embed(state, inputs, req.pooling))
        data = []
        for i, out in enumerate(outs):
            vector = out.meta_info["embedding"]
            if req.dimensions is not None:
                if req.dimensions > len(vector):
                    raise HTTPError(f"dimensions={req.dimensions} is more than the model's {len(vector)}")
                vector = vector[: req.dimensions]
            if req.normalize:
                vector = _unit(vector)
            data.append({"object": "embedding", "index": i, "embedding": vector if req.encoding_format == "float"
                         else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()})
        tokens = sum(out.meta_info["prompt_tokens"] for out in outs)
        return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        """SGLang's: `text` or `input_ids` (one, or a batch) -> {"embedding", "meta_info"} (a list for a batch)."""
        body = await json_body(request)
        given = [k for k in ("text", "input_ids") if body.get(k) is not None]
        if len(given) != 1:
            raise HTTPError("give exactly one of text or input_ids")
        single = isinstance(body[given[0]], str) or (given[0] == "input_ids" and _ids(body["input_ids"]))
        inputs = _inputs(body[given[0]])
        pooling, normalize = body.get("pooling", "last"), body.get("normalize", True)
        if not isinstance(normalize, bool):
            raise HTTPError("normalize must be a boolean")
        outs = await run_until_done(request, _embed(state, inputs, pooling))
        results = []
        for out in outs:
            meta = dict(out.meta_info)
            vector = meta.pop("embedding")
            results.append({"embedding": _unit(vector) if normalize else vector, "meta_info": meta})
        return JSONResponse(results[0] if single else results)


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _inputs(value: Any) -> list[str | list[int]]:
    """The inputs of a request: one text or one token list, or a batch of either."""
    if isinstance(value, str) or _ids(value):
        return [value]
    if not isinstance(value, list) or not value:
        raise HTTPError("input must be a string, a list of token ids, or a non-empty list of either")
    if len(value) > MAX_INPUTS:
        raise HTTPError(f"at most {MAX_INPUTS} inputs a request, not {len(value)}")
    if not all(isinstance(v, str) or _ids(v) for v in value):
        raise HTTPError("each input must be a string or a non-empty list of token ids")
    return list(value)


async def _embed(state: ServerState, inputs: list[str | list[int]], pooling: Any) -> list[Any]:
    if pooling not in POOLINGS:
        raise HTTPError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    reqs = [GenerateRequest(uuid.uuid4().hex, **({"text": x} if isinstance(x, str) else {"input_ids": x}),
                            sampling_params={"max_new_tokens": 0}, embed=pooling) for x in inputs]
    return await gather_outputs(state.client, reqs)


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector
