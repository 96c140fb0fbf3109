"""The OpenAI Responses API: ``POST /v1/responses``, stateless.

A request becomes a chat request (responses_protocol.to_chat) and runs the
chat path: the same native body, the same reading of tool calls and reasoning
(output_readers.py: ``ToolReader``, ``ReasoningReader``, ``ChoiceStream``); its answer is read back as output items, whole or as the
Responses event stream. Nothing is stored, so the endpoints that read stored
responses answer 404 saying so.
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.server import responses_protocol as rp
from radixlm.runtime.server.http_common import HTTPError, json_body
from radixlm.runtime.server.openai_api import ChatRun, parse_request
from radixlm.runtime.server.output_readers import ChoiceStream
from radixlm.runtime.server.server_state import ServerState, stream_choice
from radixlm.runtime.server.sse import sse_response


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = parse_request(rp.ResponsesRequest, await json_body(request))
        try:
            chat = rp.to_chat(req)
        except ValueError as e:
            raise HTTPError(str(e)) from None
        run = ChatRun(state, chat)
        shell = rp.response_shell(req, state.model_name)
        if req.stream:
            events = rp.EventStream(shell)
            return await sse_response(_stream(state, run.reqs, events, run.choice_stream()),
                                      fail=lambda message, _status: events.fail(message))
        return JSONResponse(rp.whole_response(shell, await run.whole(request)))

    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def stored(rest: str) -> Response:
        raise HTTPError(f"/v1/responses/{rest} is not supported: this server is stateless and stores no "
                        "responses (store=true is accepted, but nothing is kept)", 404)


def _stream(state: ServerState, reqs: list[GenerateRequest], events: rp.EventStream,
            choice: ChoiceStream) -> AsyncIterator[bytes]:
    """The events of one response; a failure after the first ends the stream with
    ``response.failed`` (sse_response, by ``events.fail``)."""
    return stream_choice(state, reqs, choice, lambda _: events.start(), events.feed,
                         lambda _, finish, usage: events.finish(finish, rp.usage(usage)))
