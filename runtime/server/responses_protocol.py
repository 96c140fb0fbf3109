"""The OpenAI Responses API's wire format (``POST /v1/responses``), as a mapping onto chat.

Stateless: a request carries the whole conversation as input items, and
nothing is stored. Three parts, free of I/O like openai_protocol.py:

* ``ResponsesRequest``: parses and range-checks a request, refusing what this
  server cannot honour (stored state, hosted tools, non-text input) with a
  message that says so;
* ``to_chat``: the same request as a ``ChatCompletionRequest``, so it runs
  the chat path unchanged (the model's template, tools, forced calls, JSON
  schemas);
* builders of the answer from the chat result: the output items
  (``output_items``), the response object (``response_shell``, ``whole_response``), and the
  event stream (``EventStream``, chat deltas in, numbered SSE events out).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from radixlm.runtime.server import openai_protocol as oa

TEXT_PARTS = frozenset({"input_text", "output_text"})


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_…``, ``msg_…``, ``fc_…``, ``rs_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- requests


class _Item(BaseModel):
    # Items passed back from an earlier response carry ids, statuses, annotations...: ignored.
    model_config = ConfigDict(extra="ignore")


class TextContent(_Item):
    type: Literal["input_text", "output_text"]
    text: str


def _only_text(content: Any) -> Any:
    if isinstance(content, list):
        other = sorted({str(p.get("type")) for p in content if isinstance(p, dict)} - TEXT_PARTS)
        if other:
            raise ValueError(f"unsupported content part type(s) {', '.join(other)}; "
                             "only input_text and output_text are supported (this server reads text only)")
    return content


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return _only_text(content)


class FunctionCallItem(_Item):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments: str) -> str:
        try:
            ok = isinstance(json.loads(arguments), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise ValueError(f"must be a JSON object (as text); got {arguments[:80]!r}")
        return arguments


class FunctionCallOutputItem(_Item):
    """The result of an earlier call, which the model reads."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, output: Any) -> Any:
        return _only_text(output)


class ReasoningText(_Item):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    """An earlier turn's reasoning: the next assistant turn's ``reasoning_content``, which a
    template that reads it (Qwen3's) shows; others drop it."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(oa.FunctionDefinition):
    """The Responses API's flat function tool: ``{"type": "function", "name", "parameters", "strict"}``."""

    type: Literal["function"]


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow a BaseModel attribute
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('a text.format of type "json_schema" needs its name and schema')
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; the others cannot be honoured


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @model_validator(mode="after")
    def _nothing_asked(self) -> ReasoningConfig:
        for key in ("effort", "summary", "generate_summary"):
            if getattr(self, key) not in (None, "none" if key == "effort" else None):
                raise ValueError(f"reasoning.{key} is not supported: how much a model reasons cannot be set "
                                 'here (only "none" for effort, which turns thinking off where the chat '
                                 "template can), nor can its reasoning be summarized; omit it")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None  # accepted, no effect: nothing is obfuscated


# Fields this server cannot honour: (the values it accepts, meaning "as if absent"; why not others).
# Those of stored state come first: a stateless server must refuse them rather than guess.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), "previous_response_id is not supported: this server is stateless and stores no "
                                 "responses; send the whole conversation (earlier output items included) as input"),
    "conversation": ((), "conversation is not supported: this server is stateless and stores no conversations; "
                         "send the whole conversation as input"),
    "prompt": ((), "prompt (a stored prompt template) is not supported: this server stores no prompts; "
                   "send instructions and input instead"),
    "background": ((False,), "background is not supported: this server stores no responses to fetch later"),
    "include": (([],), "include is not supported: there is no extra output data (logprobs, encrypted "
                       "reasoning) to add"),
    "top_logprobs": ((0,), "top_logprobs is not supported on /v1/responses; /v1/chat/completions returns logprobs"),
    "max_tool_calls": ((), "max_tool_calls is not supported; parallel_tool_calls=false allows one call"),
    "truncation": (("disabled",), 'truncation "auto" is not supported: an input longer than the context is '
                                  "refused, not cut"),
}
# OpenAI request fields with no effect on a local model server (bookkeeping, billing): accepted, dropped.
_NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"})


class ResponsesRequest(oa.SamplingExtras):
    """Body of ``POST /v1/responses``.

    As on the chat endpoints, an unknown field is refused (400 naming it) and
    JSON ``null`` means the default. ``store`` is accepted but nothing is
    stored; the fields of stored state (``previous_response_id``,
    ``conversation``, ``prompt``) are refused. SGLang's sampling extras (``SamplingExtras``:
    ``top_k``, ``min_p``, penalties, ``seed``, ``stop``) go to the chat request as they are.
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    input: list[InputItem] = Field(min_length=1)  # a string is one user message
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=oa.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    store: bool | None = None  # accepted; nothing is stored
    reasoning: ReasoningConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, (allowed, why) in _REFUSED.items():
            if data.get(key) is not None and not any(data[key] == a and type(data[key]) is type(a) for a in allowed):
                raise ValueError(why)
        data = {k: v for k, v in data.items() if v is not None and k not in _NO_EFFECT and k not in _REFUSED}
        if isinstance(data.get("input"), str):
            data["input"] = [{"type": "message", "role": "user", "content": data["input"]}]
        if isinstance(data.get("input"), list):
            data["input"] = [_typed(item) for item in data["input"]]
        for i, tool in enumerate(data.get("tools") or ()):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(f"tools[{i}] is of type {tool.get('type')!r}; only function tools are supported")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(f"tool_choice of type {choice.get('type')!r} is not supported; allowed: "
                             '"none", "auto", "required" or {"type": "function", "name": ...}')
        return data

    @property
    def format(self) -> TextFormat:
        return (self.text.format if self.text else None) or TextFormat(type="text")


def _typed(item: Any) -> Any:
    """An input item with its type: OpenAI's "easy" messages leave it out."""
    if not isinstance(item, dict):
        return item
    if item.get("type") == "item_reference":
        raise ValueError("item_reference is not supported: this server is stateless and stores no items; "
                         "send the items themselves")
    return item if "type" in item else {**item, "type": "message"}


# -------------------------------------------------------------- conversion


def to_chat(req: ResponsesRequest) -> oa.ChatCompletionRequest:
    """The chat request that generates this response. Raises ``ValueError`` for a combination
    chat refuses (a forced call with a JSON format...), in the Responses API's terms."""
    fmt = req.format
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _chat_messages(req),
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": {"type": fmt.type} if fmt.type != "json_schema" else {
            "type": "json_schema", "json_schema": fmt.model_dump(include={"name", "schema_", "strict", "description"},
                                                                 by_alias=True, exclude_none=True)},
        **req.model_dump(include=set(oa.SamplingExtras.model_fields)),
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": _chat_function(t)} for t in req.tools]
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}  # Qwen3's switch; other templates ignore it
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None and (req.tools or req.tool_choice != "auto"):
        # "auto" beside no tools is what OpenAI's own response objects carry (tools: []): nothing
        # to choose from, so nothing to ask; "required" with no tools stays an error
        body["tool_choice"] = req.tool_choice
    try:
        return oa.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        message = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(message.replace("response_format", "text.format")) from None


def _chat_function(tool: FunctionTool) -> dict[str, Any]:
    # OpenAI's Responses API makes function tools strict unless they say otherwise
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
            "strict": tool.strict is not False}


def _chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions as the system message; calls join the
    assistant turn before them (or make one), their outputs become tool turns; reasoning goes
    to the assistant turn after it."""
    out: list[dict[str, Any]] = []
    if req.instructions is not None:
        out.append({"role": "system", "content": req.instructions})
    thought: str | None = None
    for item in req.input:
        if isinstance(item, ReasoningItem):
            thought = "\n".join(part.text for part in item.content or ()) or None
            continue
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and thought is None:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
        if thought is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = thought
        thought = None
    return out


def _chat_content(content: str | list[TextContent]) -> str | list[dict[str, str]]:
    return content if isinstance(content, str) else [{"type": "text", "text": p.text} for p in content]


# -------------------------------------------------------------- the answer


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [_output_text(text)]}


def function_call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """``call``: a chat tool call (``{"id", "function": {"name", "arguments"}}``)."""
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if status == "in_progress" else [_reasoning_text(text)]}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def status_of(finish: str | None) -> str:
    """The response's status for the chat finish reason: a length cut leaves it incomplete."""
    return "incomplete" if finish == "length" else "completed"


def output_items(message: dict[str, Any], finish: str) -> list[dict[str, Any]]:
    """The output items of a whole chat message: reasoning, text, then calls (an empty message
    only when there is nothing else). Only the last one is cut short by a length limit; the ones
    before it are whole."""
    items: list[tuple[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(("reasoning", message["reasoning_content"]))
    if message.get("content") or not (items or message.get("tool_calls")):
        items.append(("message", message.get("content") or ""))
    items += [("function_call", call) for call in message.get("tool_calls") or ()]
    last = len(items) - 1
    return [_item(kind, value, status_of(finish) if i == last else "completed")
            for i, (kind, value) in enumerate(items)]


def _item(kind: str, value: Any, status: str, item_id: str | None = None) -> dict[str, Any]:
    if kind == "message":
        return message_item(item_id or new_id("msg"), value, status)
    if kind == "reasoning":
        return reasoning_item(item_id or new_id("rs"), value, status)
    return function_call_item(item_id or new_id("fc"), value, status)


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Responses usage from chat usage. No reasoning is counted apart, and no billed cache writes."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_shell(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The Response object in progress, without output: a fresh id, and the request's settings
    echoed, as OpenAI does."""
    fmt = req.format.model_dump(by_alias=True, exclude_none=True)
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
        **response_status("in_progress"), "error": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "metadata": req.metadata or {}, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None}, "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": choice or "auto",
        "tools": [{**_chat_function(t), "type": "function"} for t in req.tools or ()],
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": 0, "truncation": "disabled",
        "usage": None,
    }


def whole_response(shell: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """The finished response from the chat completion it ran as (one choice)."""
    choice = chat["choices"][0]
    output = output_items(choice["message"], choice["finish_reason"])
    return finished(shell, status_of(choice["finish_reason"]), output, usage(chat["usage"]))


def finished(shell: dict[str, Any], status: str, output: list[dict[str, Any]],
             usage_: dict[str, Any]) -> dict[str, Any]:
    return {**shell, **response_status(status), "output": output, "usage": usage_}


def response_status(status: str) -> dict[str, Any]:
    """The fields of a response object that its status sets."""
    return {"status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}


# --------------------------------------------------------------- streaming


class EventStream:
    """One streamed response: chat deltas (``content``, ``reasoning_content``, ``tool_calls`` as
    ToolStream makes them) in, Responses events out, as SSE bytes numbered by ``sequence_number``.

    One output item is open at a time; a delta of another kind (a call after text, a second
    call) closes it, whole, and opens the next. The last one closes with the response's status.
    """

    def __init__(self, shell: dict[str, Any]) -> None:
        self.shell = shell  # the in-progress response object, without output
        self.seq = 0
        self.done: list[dict[str, Any]] = []  # closed items, final
        self.open: dict[str, Any] | None = None  # {"kind", "id", "value"}; value: text or the call

    def start(self) -> bytes:
        return (self._event("response.created", response=self.shell)
                + self._event("response.in_progress", response=self.shell))

    def feed(self, deltas: list[dict[str, Any]]) -> bytes:
        out = b""
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                if call.get("id"):  # a new call: its first delta names it
                    out += self._close("completed") + self._open("function_call", {**call, "function": {
                        "name": call["function"]["name"], "arguments": ""}})
                if args := call["function"].get("arguments"):
                    self.open["value"]["function"]["arguments"] += args
                    out += self._event("response.function_call_arguments.delta", **self._where(), delta=args)
        return out

    def finish(self, finish: str, usage_: dict[str, Any]) -> bytes:
        status = status_of(finish)
        out = self._close(status)
        if not self.done:  # nothing was generated: still one (empty) message
            out += self._open("message", "") + self._close(status)
        final = finished(self.shell, status, self.done, usage_)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=final)

    def fail(self, message: str) -> bytes:
        """The last event of a stream that broke after it started (a runtime failure, an abort)."""
        failed = {**self.shell, "status": "failed", "output": self.done,
                  "error": {"code": "server_error", "message": message}}
        return self._event("response.failed", response=failed)

    # -- items

    def _text(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["kind"] != kind:
            out += self._close("completed") + self._open(kind, "")
        self.open["value"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + self._event(name, **self._where(), content_index=0, delta=text, **extra)

    def _open(self, kind: str, value: Any) -> bytes:
        item_id = new_id({"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind])
        self.open = {"kind": kind, "id": item_id, "value": value}
        out = self._event("response.output_item.added", output_index=len(self.done),
                          item=_item(kind, value, "in_progress", item_id))
        if kind == "function_call":
            return out
        part = _output_text("") if kind == "message" else _reasoning_text("")
        return out + self._event("response.content_part.added", **self._where(), content_index=0, part=part)

    def _close(self, status: str) -> bytes:
        if self.open is None:
            return b""
        kind, value = self.open["kind"], self.open["value"]
        item = _item(kind, value, status, self.open["id"])
        if kind == "function_call":
            out = self._event("response.function_call_arguments.done", **self._where(),
                              name=value["function"]["name"], arguments=value["function"]["arguments"])
        else:
            name = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if kind == "message" else {}
            out = (self._event(name, **self._where(), content_index=0, text=value, **extra)
                   + self._event("response.content_part.done", **self._where(), content_index=0,
                                 part=item["content"][0]))
        out += self._event("response.output_item.done", output_index=len(self.done), item=item)
        self.done.append(item)
        self.open = None
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
