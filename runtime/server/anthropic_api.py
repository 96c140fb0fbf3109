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
from radixlm.runtime.native import native_requests, native_result
from radixlm.runtime.reasoning import reasoning_format
from radixlm.runtime.server import anthropic_protocol as ap
from radixlm.runtime.server.http_common import HTTPError, error_response, json_body, run_until_done
from radixlm.runtime.server.openai_api import chat_body, parse_request
from radixlm.runtime.server.openai_builders import RequestAborted, aggregate_usage, chat_response, \
    matched_stop, openai_finish_reason
from radixlm.runtime.server.output_readers import ChoiceStream, ReasoningReader, ToolReader
from radixlm.runtime.server.server_state import ServerState, gather_outputs, merge_streams
from radixlm.runtime.server.sse import sse_response


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = parse_request(ap.MessagesRequest, await json_body(request))
        chat = _chat(req)
        parser = state.server_args.get("reasoning_parser")
        reqs, _ = native_requests(chat_body(chat, reasoning_format(parser) if parser else None))
        tools, reasoning = ToolReader.of(chat), ReasoningReader.of(chat, parser)
        if req.stream:
            events = ap.EventStream(req, state.model_name)
            return await sse_response(_stream(state, reqs, events, ChoiceStream(tools, reasoning)), fail=events.fail,
                                      refuse=lambda message, status: error_response(message, status, "/v1/messages"))
        outs = await run_until_done(request, gather_outputs(state.client, reqs))
        try:
            answer = chat_response([native_result(o) for o in outs], state.model_name, "", False, 0,
                                   lambda _: "", tools, reasoning)
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None
        return JSONResponse(ap.whole_message(req, state.model_name, answer))

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


async def _stream(state: ServerState, reqs: list[GenerateRequest], events: ap.EventStream,
                  choice: ChoiceStream) -> AsyncIterator[bytes]:
    """The events of one message. The first is sent once the runtime has answered (it knows the
    prompt's tokens then), so a request it refuses gets a plain 4xx; a failure after that ends the
    stream with an ``error`` event (sse_response, by ``events.fail``)."""
    started = False
    async for _, out in merge_streams(state.client, reqs):
        if not started:
            yield events.start(out.meta_info.get("prompt_tokens", 0), out.meta_info.get("cached_tokens", 0))
            started = True
        result = native_result(out)
        try:
            finish = openai_finish_reason(out.meta_info.get("finish_reason")) if out.finished else None
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None
        yield events.feed(choice.feed(result["text"], out.finished))
        if out.finished:
            yield events.finish(finish, matched_stop(out.meta_info.get("finish_reason")),
                                aggregate_usage([result], 1), choice.called)
