"""Server-sent events, the streamed answers of every endpoint: one event (``sse``) and the
streaming response (``sse_response``), which answers a request refused before its first event
with a plain error response, and ends a stream that fails later, whatever the exception, with
the protocol's own error event.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import orjson
from fastapi.responses import Response, StreamingResponse

from radixlm.runtime.client import RequestFailed
from radixlm.runtime.server.http_common import HTTPError, error_response, internal_error


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(message: str, status: int) -> bytes:
    """The end of a failed stream of chat/completions chunks or native chunks: SGLang's and
    OpenAI's error object as one event, then ``[DONE]``."""
    return sse({"error": {"message": message, "code": status}}) + b"data: [DONE]\n\n"


async def sse_response(chunks: AsyncIterator[bytes], fail: Callable[[str, int], bytes] = error_event,
                       refuse: Callable[[str, int], Response] = error_response) -> Response:
    """Stream server-sent events. The first chunk is awaited here, so a refused request
    (bad input) gets a plain 4xx response instead of an event stream. After that, an exception
    ends the stream with ``fail(message, status)``: a refusal or an abort with its own message,
    anything else as an internal error, logged with an id the message names. `refuse` makes the
    plain error response (the protocol's shape)."""
    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except (RequestFailed, HTTPError) as e:
        return refuse(str(e), e.status)

    async def body() -> AsyncIterator[bytes]:
        yield first
        try:
            async for chunk in it:
                yield chunk
        except (RequestFailed, HTTPError) as e:
            yield fail(str(e), e.status)
        except Exception as e:  # a defect of ours: the client still gets the protocol's last event
            yield fail(internal_error(e, "a stream"), 500)

    return StreamingResponse(body(), media_type="text/event-stream")
