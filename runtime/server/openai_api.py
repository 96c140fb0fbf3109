"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Each request is validated with the models in openai_protocol.py, turned into
the native /generate body (openai_to_native.py), run through the same path as
/generate, and answered in OpenAI's shapes (openai_builders.py: whole objects or
SSE chunks), its tool calls and reasoning read by output_readers.py.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.native import native_requests, native_result
from radixlm.runtime.reasoning import ReasoningFormat, reasoning_format
from radixlm.runtime.server.http_common import HTTPError, json_body, run_until_done
from radixlm.runtime.server.openai_builders import (
    RequestAborted, VllmOptions, aggregate_usage, chat_chunk, chat_logprobs, chat_response, completion_chunk,
    completion_logprobs, completion_response, matched_stop, new_request_id, openai_finish_reason, usage_chunk,
)
from radixlm.runtime.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixlm.runtime.server.openai_to_native import chat_messages, chat_to_generate, completion_to_generate
from radixlm.runtime.server.output_readers import ChoiceStream, ReasoningReader, ToolReader
from radixlm.runtime.server.server_state import ServerState, gather_outputs, merge_streams
from radixlm.runtime.server.sse import sse, sse_response


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    # One model is served, so a request's `model` is not checked (as SGLang does): any name means it,
    # unless it names a LoRA adapter served (the scheduler decides when it takes the request)
    @app.get("/v1/models")
    async def models() -> dict:
        adapters = await state.lora_adapters()
        return {"object": "list", "data": [_model_card(state)] + [_adapter_card(state, n, p) for n, p in adapters.items()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        adapters = await state.lora_adapters()
        if model in adapters:
            return _adapter_card(state, model, adapters[model])
        if model != state.model_name:
            raise HTTPError(f"model {model!r} does not exist; this server serves {state.model_name!r}", 404)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await json_body(request))
        body = completion_to_generate(req)
        vllm = _vllm_options(req)
        return await _run(request, state, body, req, chat=False, vllm=vllm, build=lambda results, rid: completion_response(
            results, state.model_name, rid, _echo_prompts(req, results), req.logprobs, _decoder(results), n=req.n,
            vllm=vllm))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await json_body(request))
        parser = state.server_args.get("reasoning_parser")
        body = chat_body(req, reasoning_format(parser) if parser else None)
        tools = ToolReader.of(req)
        reasoning = ReasoningReader.of(req, parser)
        vllm = _vllm_options(req, _echo_message(body["messages"]) if req.echo else None)
        return await _run(request, state, body, req, chat=True, tools=tools, reasoning=reasoning, vllm=vllm,
                          build=lambda results, rid: chat_response(
                              results, state.model_name, rid, bool(req.logprobs), req.top_logprobs or 0,
                              _decoder(results), tools, reasoning, vllm))


async def _run(request: Request, state: ServerState, body: dict[str, Any], req: Any, chat: bool,
               build: Callable[[list[dict[str, Any]], str], dict[str, Any]], vllm: VllmOptions,
               tools: ToolReader | None = None, reasoning: ReasoningReader | None = None) -> Response:
    """Run a converted request: stream chunks, or wait for every result and `build` the answer."""
    reqs = for_model(native_requests(body)[0], req.model)
    rid = new_request_id()
    if req.stream:
        return await sse_response(_stream(state, reqs, req, rid, chat, vllm, tools, reasoning))
    outs = await run_until_done(request, gather_outputs(state.client, reqs))
    results = [native_result(o) for o in outs]
    try:
        return JSONResponse(build(results, rid))
    except RequestAborted as e:
        raise HTTPError(f"the request was aborted: {e}", 500) from None


def chat_body(req: ChatCompletionRequest, reasoning: ReasoningFormat | None = None) -> dict[str, Any]:
    """The native body of a chat request (also /v1/responses'): the messages, not a prompt text,
    since the tokenizer process renders them with the model's template. With the server's
    `reasoning` format (--reasoning-parser), a constraint waits for the reasoning to end."""
    try:
        messages = chat_messages(req)
    except ValueError as e:
        raise HTTPError(str(e)) from None
    body = chat_to_generate(req, prompt_text="", reasoning=reasoning)
    del body["text"]
    body["messages"] = messages
    return body


class ChatRun:
    """A chat request run for another protocol (the Responses and Messages APIs): its native
    requests, and its choice's readers of tool calls and reasoning, by the server's parser. A
    forced call whose arguments never began is left out (``ToolReader.unbegun_call``)."""

    def __init__(self, state: ServerState, chat: Any) -> None:
        parser = state.server_args.get("reasoning_parser")
        self.state = state
        body = chat_body(chat, reasoning_format(parser) if parser else None)
        self.reqs = for_model(native_requests(body)[0], chat.model)
        self.tools, self.reasoning = ToolReader.of(chat, unbegun_call=False), ReasoningReader.of(chat, parser)

    def choice_stream(self) -> ChoiceStream:
        return ChoiceStream(self.tools, self.reasoning)

    async def whole(self, request: Any) -> dict[str, Any]:
        """The choice run to its end, as the chat completion object."""
        outs = await run_until_done(request, gather_outputs(self.state.client, self.reqs))
        try:
            return chat_response([native_result(o) for o in outs], self.state.model_name, "", False, 0,
                                 lambda _: "", self.tools, self.reasoning)
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None


def parse_request(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise HTTPError(f"{where}: {first['msg']}" if where else first["msg"]) from None


def _model_card(state: ServerState) -> dict[str, Any]:
    """The served model as vLLM lists it: `root` the weights served, no `parent`."""
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "radixlm",
            "root": state.server_args.get("model_path") or state.model_name, "parent": None,
            "max_model_len": state.info.get("context_length")}


def _adapter_card(state: ServerState, name: str, path: str) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists one: its own id, the base model as parent."""
    return {**_model_card(state), "id": name, "root": path, "parent": state.model_name}


def for_model(reqs: list[GenerateRequest], model: str | None) -> list[GenerateRequest]:
    """The requests of an OpenAI or Anthropic body that names `model`: on the adapter of that
    name if one is served when the scheduler takes them, else on the base model."""
    for r in reqs:
        r.model = model
    return reqs


def _vllm_options(req: CompletionRequest | ChatCompletionRequest, echo: str | None = None) -> VllmOptions:
    return VllmOptions(req.return_token_ids, req.prompt_logprobs, echo)


def _echo_message(messages: list[dict[str, Any]]) -> str | None:
    """Chat's `echo` (vLLM's): the last message's text when it is the assistant's, which the reply
    continues (with continue_final_message) or follows."""
    return messages[-1]["content"] or None if messages[-1]["role"] == "assistant" else None


def _echo_prompts(req: CompletionRequest, results: list[dict[str, Any]]) -> list[str] | None:
    """Each prompt's echoed text, if the request asks for `echo` (`results`: prompt-major)."""
    if not req.echo:
        return None
    return [_echo_text(req, i, results[i * req.n]) for i in range(req.num_prompts)]


def _echo_text(req: CompletionRequest, prompt: int, result: dict[str, Any]) -> str:
    """What `echo` puts before the output of prompt number `prompt` (`result`: one of its choices):
    the text sent, or its token ids as the runtime decoded them, one by one (the texts of the prompt's
    logprob entries, which completion_to_generate asks for)."""
    sent = req.prompts[prompt]
    if isinstance(sent, str):
        return sent
    return "".join(entry[2] for entry in result["meta_info"]["input_token_logprobs"])


def _decoder(results: list[dict[str, Any]]) -> Callable[[int], str]:
    """Token id -> text, from the texts the tokenizer process put into the logprob entries."""
    texts: dict[int, str] = {}

    def collect(entries: Any) -> None:
        for e in entries or ():
            if e is None:
                continue
            if e and isinstance(e[0], list):
                collect(e)
            elif len(e) >= 3:
                texts[e[1]] = e[2]

    for r in results:
        meta = r["meta_info"]
        for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
            collect(meta.get(key))
    return lambda token_id: texts.get(token_id, "")


async def _stream(state: ServerState, reqs: list[GenerateRequest], req: Any, rid: str, chat: bool, vllm: VllmOptions,
                  tools: ToolReader | None, reasoning: ReasoningReader | None) -> AsyncIterator[bytes]:
    created = int(time.time())
    model = state.model_name
    finals: dict[int, dict[str, Any]] = {}
    started: set[int] = set()
    choice_streams: dict[int, ChoiceStream] = {}
    async for index, out in merge_streams(state.client, reqs):
        result = native_result(out)
        native_finish = out.meta_info.get("finish_reason") if out.finished else None
        try:
            finish = openai_finish_reason(native_finish)
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None
        matched = matched_stop(native_finish)
        if out.finished:
            finals[index] = result
        first = index not in started
        started.add(index)
        for chunk in _chunks(req, rid, model, created, index, result, first, chat, finish, matched,
                             choice_streams, tools, reasoning, vllm):
            if req.continuous_usage:  # (vLLM's and SGLang's: the choice's usage so far on every chunk)
                chunk["usage"] = aggregate_usage([result], 1)
            yield sse(chunk)
    if req.include_usage:
        ordered = [finals[i] for i in sorted(finals)]
        yield sse(usage_chunk(rid, model, created, aggregate_usage(ordered, req.n), chat=chat))
    yield b"data: [DONE]\n\n"


def _chunks(req: Any, rid: str, model: str, created: int, index: int, result: dict[str, Any], first: bool,
            chat: bool, finish: str | None, matched: int | str | None, choice_streams: dict[int, ChoiceStream],
            tools: ToolReader | None, reasoning: ReasoningReader | None, vllm: VllmOptions) -> list[dict[str, Any]]:
    """The chunks of one runtime output of choice `index` (`first`: the choice's first output)."""
    ids = vllm.output_fields(result)  # (vLLM's return_token_ids: the new ids, the prompt's on the first chunk)
    prompt = {"prompt_token_ids": result.get("prompt_token_ids")} if first and vllm.token_ids else {}
    if not chat:
        echo = req.echo and first  # a choice's first chunk begins with the prompt
        text = _echo_text(req, index // req.n, result) + result["text"] if echo else result["text"]
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(result["meta_info"], _decoder([result]), echo=echo, top=req.logprobs)
        chunk = completion_chunk(rid, model, created, index, text, finish, lp, matched)
        chunk["choices"][0].update(prompt | ids)
        return [chunk]
    lp = chat_logprobs(result["meta_info"], req.top_logprobs or 0, _decoder([result])) if req.logprobs else None
    stream = choice_streams.setdefault(index, ChoiceStream(tools, reasoning))
    deltas = stream.feed(result["text"], finish is not None)
    if finish is not None and stream.called:
        finish = tools.finish_reason(finish)
    if first and vllm.echo:  # vLLM's echo: the last (assistant) message, before the reply
        deltas = [{"content": vllm.echo}, *deltas]
    if not deltas and (finish is not None or lp is not None or ids or first):
        deltas = [{}]  # still a chunk: it carries the role, the finish reason, the logprobs or the ids
    if first:  # the choice's first delta says its role
        deltas[0] = {"role": "assistant", **deltas[0]}
    chunks = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        chunk = chat_chunk(rid, model, created, index, delta, finish if last else None, lp if i == 0 else None,
                           matched if last else None)
        if i == 0:
            chunk["choices"][0].update(ids)
        chunks.append(chunk | prompt if i == 0 else chunk)
    return chunks
