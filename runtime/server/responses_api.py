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
from radixlm.runtime.native import native_requests, native_result
from radixlm.runtime.reasoning import reasoning_format
from radixlm.runtime.server import responses_protocol as rp
from radixlm.runtime.server.http_common import HTTPError, json_body, run_until_done
from radixlm.runtime.server.openai_api import chat_body, parse_request
from radixlm.runtime.server.openai_builders import RequestAborted, aggregate_usage, chat_response, openai_finish_reason
from radixlm.runtime.server.output_readers import ChoiceStream, ReasoningReader, ToolReader
from radixlm.runtime.server.server_state import ServerState, gather_outputs, merge_streams
from radixlm.runtime.server.sse import sse_response


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = parse_request(rp.ResponsesRequest, await json_body(request))
        try:
            chat = rp.to_chat(req)
        except ValueError as e:
            raise HTTPError(str(e)) from None
        parser = state.server_args.get("reasoning_parser")
        reqs, _ = native_requests(chat_body(chat, reasoning_format(parser) if parser else None))
        tools, reasoning = ToolReader.of(chat), ReasoningReader.of(chat, parser)
        shell = rp.response_shell(req, state.model_name)
        if req.stream:
            events = rp.EventStream(shell)
            return await sse_response(_stream(state, reqs, events, ChoiceStream(tools, reasoning)),
                                      fail=lambda message, _status: events.fail(message))
        outs = await run_until_done(request, gather_outputs(state.client, reqs))
        try:
            answer = chat_response([native_result(o) for o in outs], state.model_name, "", False, 0,
                                   lambda _: "", tools, reasoning)
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None
        return JSONResponse(rp.whole_response(shell, answer))

    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def stored(rest: str) -> Response:
        raise HTTPError(f"/v1/responses/{rest} is not supported: this server is stateless and stores no "
                        "responses (store=true is accepted, but nothing is kept)", 404)


async def _stream(state: ServerState, reqs: list[GenerateRequest], events: rp.EventStream,
                  choice: ChoiceStream) -> AsyncIterator[bytes]:
    """The events of one response. The first is sent once the runtime has answered, so a request it
    refuses gets a plain 4xx; a failure after that ends the stream with ``response.failed``
    (sse_response, by ``events.fail``)."""
    started = False
    async for _, out in merge_streams(state.client, reqs):
        if not started:
            yield events.start()
            started = True
        result = native_result(out)
        try:
            finish = openai_finish_reason(out.meta_info.get("finish_reason")) if out.finished else None
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None
        yield events.feed(choice.feed(result["text"], out.finished))
        if out.finished:
            yield events.finish(finish, rp.usage(aggregate_usage([result], 1)))
