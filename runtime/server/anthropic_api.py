"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes a chat request (anthropic_protocol.to_chat) and runs the chat path: the same
native body, the same reading of tool calls and reasoning (output_readers.py); its answer is
read back as a Message, whole or as Anthropic's event stream. Errors on these paths take
Anthropic's shape (http_common.error_response, by path).
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.server import anthropic_protocol as ap
from radixlm.runtime.server.http_common import HTTPError, error_response, json_body
from radixlm.runtime.server.openai_api import ChatRun, chat_body, parse_request
from radixlm.runtime.server.openai_builders import matched_stop
from radixlm.runtime.server.output_readers import ChoiceStream
from radixlm.runtime.server.server_state import ServerState, stream_choice
from radixlm.runtime.server.sse import sse_response


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = parse_request(ap.MessagesRequest, await json_body(request))
        run = ChatRun(state, _chat(req))
        if req.stream:
            events = ap.EventStream(req, state.model_name)
            return await sse_response(_stream(state, run.reqs, events, run.choice_stream()), fail=events.fail,
                                      refuse=lambda message, status: error_response(message, status, "/v1/messages"))
        return JSONResponse(ap.whole_message(req, state.model_name, await run.whole(request)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        """The prompt's tokens as the chat template renders it (tools included), without running it."""
        req = parse_request(ap.CountTokensRequest, await json_body(request))
        body = chat_body(_chat(req))
        answer = await state.client.control("tokenize", {
            "messages": body["messages"], "tools": body.get("tools"),
            "chat_template_kwargs": body.get("chat_template_kwargs")})
        if "error" in answer:
            raise HTTPError(answer["error"], answer.get("status", 400))
        return {"input_tokens": len(answer["input_ids"])}


def _chat(req: ap.MessagesRequest | ap.CountTokensRequest):
    try:
        return ap.to_chat(req)
    except ValueError as e:
        raise HTTPError(str(e)) from None


def _stream(state: ServerState, reqs: list[GenerateRequest], events: ap.EventStream,
            choice: ChoiceStream) -> AsyncIterator[bytes]:
    """The events of one message, the first with the prompt's token counts; a failure after it ends
    the stream with an ``error`` event (sse_response, by ``events.fail``)."""
    return stream_choice(
        state, reqs, choice,
        lambda out: events.start(out.meta_info.get("prompt_tokens", 0), out.meta_info.get("cached_tokens", 0)),
        events.feed,
        lambda out, finish, usage: events.finish(finish, matched_stop(out.meta_info.get("finish_reason")), usage,
                                                 choice.called))
