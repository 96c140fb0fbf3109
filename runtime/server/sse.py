"""Server-sent events, the streamed answers of every endpoint: one event (``sse``) and the
streaming response (``sse_response``), which answers a request refused before its first event
with a plain error response, and ends a stream that fails later with an error event.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import orjson
from fastapi.responses import Response, StreamingResponse

from radixlm.runtime.client import RequestFailed
from radixlm.runtime.server.http_common import HTTPError, error_response


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
