"""Anthropic's Messages API wire format (``POST /v1/messages``, ``/v1/messages/count_tokens``), as a
mapping onto chat, free of I/O like responses_protocol.py:

* ``MessagesRequest``: parses and range-checks a request (content blocks: text, tool_use,
  tool_result, thinking, text documents and search results, read as their text), refusing what a
  text-only local server cannot honour (images, PDF and URL documents, server tools) with a
  message that says so;
* ``to_chat``: the same request as a ``ChatCompletionRequest`` (system prompt, turns, system
  turns where they stand, a trailing assistant turn continued, tools and ``tool_choice``: auto,
  any = required, tool = named, none; thinking off unless asked for, as Qwen3's template switch),
  so it runs the chat path unchanged;
* the answer built from the chat result (``whole_message``) or streamed (``EventStream``: chat
  deltas in, ``message_start``, ``content_block_start/delta/stop``, ``ping``, ``message_delta``,
  ``message_stop`` out), and errors in Anthropic's shape (``error_body``).

Usage reports the prompt tokens the radix cache supplied as ``cache_read_input_tokens`` and the
rest as ``input_tokens`` (Anthropic counts them apart); nothing is a cache write.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from radixlm.runtime.server import openai_protocol as oa

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
# request fields with no effect on a local server (caching hints, billing, routing): accepted, dropped
_NO_EFFECT = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "container",
                        "user_profile_id", "workspace_id", "diagnostics"})


def new_id(prefix: str) -> str:
    """An id as Anthropic writes them: ``msg_…``, ``toolu_…``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------- requests


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations...: no effect here


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class DocumentSource(BaseModel):
    """A document's text: plain text (`data`), or `content` (a string or text blocks). Base64 (a
    PDF) and URL sources are refused before this is read (`_refuse_sources`): the served model
    reads text, and nothing is fetched."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "content"]
    data: str | None = None
    content: str | list[TextBlock] | None = None

    @property
    def text(self) -> str:
        if self.type == "text":
            return self.data or ""
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or ())


class DocumentBlock(_Block):
    """A text document, given to the model as its title, context and text."""

    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None

    @property
    def text(self) -> str:
        return "\n".join(part for part in (self.title, self.context, self.source.text) if part)


class SearchResultBlock(_Block):
    """A search result (a tool's, or the user's), given to the model as its title, source and text."""

    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]

    @property
    def text(self) -> str:
        return "\n".join([f"{self.title} ({self.source})", *(b.text for b in self.content)])


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | DocumentBlock | SearchResultBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | DocumentBlock
                  | SearchResultBlock, Field(discriminator="type")]
_BLOCK_TYPES = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking", "document", "search_result"}
_RESULT_TYPES = {"text", "document", "search_result"}  # what a tool_result's content may hold


def _refuse_source(kind: Any) -> None:
    if kind not in ("text", "content"):
        raise ValueError(f"a document's source of type {kind!r} is not supported: the served model reads text only "
                         "(a source of type text with its data, or content)")


def _refuse_sources(content: Any) -> None:
    """Refuses a document block in `content` whose source is no text (checked before the fields, as
    `_refuse_blocks`, so the message names it)."""
    for b in content if isinstance(content, list) else ():
        if isinstance(b, dict) and b.get("type") == "document" and isinstance(b.get("source"), dict):
            _refuse_source(b["source"].get("type"))


def _refuse_blocks(content: Any, allowed: set[str], where: str, what: str) -> None:
    """Refuses `content` (a list of blocks) holding a block type not in `allowed`, naming it."""
    if isinstance(content, list):
        other = sorted({str(b.get("type")) for b in content if isinstance(b, dict)} - allowed)
        if other:
            raise ValueError(f"{where} has blocks of type {', '.join(other)}, which are not supported: the served "
                             f"model reads text only ({what})")


class InputMessage(BaseModel):
    """One turn. A ``system`` turn among the messages (Claude Code sends them; SGLang and vLLM take
    them) stays a system message where it stands: see ``_chat_messages``."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        # (checked before the fields: a bad block in the list would otherwise be reported as the
        # content's failing to be a string, the union's first member)
        if not isinstance(data, dict):
            return data
        content, system = data.get("content"), data.get("role") == "system"
        _refuse_blocks(content, {"text"} if system else _BLOCK_TYPES, "a system turn" if system else "a message",
                       "text blocks" if system else
                       "text, tool_use, tool_result, thinking, text document and search_result blocks")
        _refuse_sources(content)
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") == "tool_result":
                _refuse_blocks(block.get("content"), _RESULT_TYPES, "a tool_result's content",
                               "a string, or text, text document and search_result blocks")
                _refuse_sources(block.get("content"))
        return data


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: oa.FunctionName  # the tool-use guide's ^[a-zA-Z0-9_-]{1,64}$, OpenAI's too
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice names a tool exactly when its type is "tool"')
        return self


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: str | None = None


class CountTokensRequest(BaseModel):
    """Body of ``POST /v1/messages/count_tokens``: the prompt's part of a Messages request. An unknown
    field is refused (400 naming it), as is a block or tool this server cannot read."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=oa.MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for i, tool in enumerate(data.get("tools") or ()):
            if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                raise ValueError(f"tools[{i}] is of type {tool.get('type')!r}: server tools are not supported, "
                                 "only client tools (name, description, input_schema)")
        return {k: v for k, v in data.items() if v is not None and k not in _NO_EFFECT}


class MessagesRequest(CountTokensRequest):
    """Body of ``POST /v1/messages``: the prompt's part and the output's settings.
    ``thinking.budget_tokens`` is accepted, not enforced (the reasoning ends where the model ends
    it, within ``max_tokens``)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)


# -------------------------------------------------------------- conversion


def to_chat(req: MessagesRequest | CountTokensRequest) -> oa.ChatCompletionRequest:
    """The chat request that generates this message. Raises ``ValueError`` in the Messages API's
    terms for what chat refuses.

    Thinking is off unless ``thinking`` asks for it (``enabled``, or ``adaptive``: the model
    decides), Anthropic's default; off is Qwen3's template switch, which other templates ignore. A
    last message of the assistant's is a prefill: the reply continues its text (chat's
    ``continue_final_message``), so it is content, not reasoning."""
    messages = _chat_messages(req)
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    body: dict[str, Any] = {"model": req.model, "messages": messages,
                            "continue_final_message": _prefill(messages, thinking)}
    if isinstance(req, MessagesRequest):
        body.update(max_completion_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None and (req.tools or choice.type == "none"):
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"any": "required"}.get(choice.type, choice.type))
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    elif choice is not None and choice.type in ("any", "tool"):
        raise ValueError(f'tool_choice "{choice.type}" needs tools')
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return oa.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None


def _prefill(messages: list[dict[str, Any]], thinking: bool) -> bool:
    """Whether the reply continues a last message of the assistant's; ValueError where it cannot."""
    if not messages or messages[-1]["role"] != "assistant":
        return False
    if messages[-1].get("tool_calls"):
        raise ValueError("the last message is the assistant's and holds tool_use blocks: only text can be continued; "
                         "send each call's tool_result in a user message")
    if thinking:
        raise ValueError("a last message of the assistant's (a prefill) cannot be continued with thinking enabled, "
                         "as in Anthropic's API: leave it out, or turn thinking off")
    text = messages[-1]["content"] or ""  # (an assistant turn's text, joined: _chat_messages)
    if text != text.rstrip():  # (a space would be tokenized apart from the word the reply goes on with)
        raise ValueError("final assistant content cannot end with trailing whitespace (a prefill), as in "
                         "Anthropic's API")
    return True


def _chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first; a user turn's tool results
    become tool turns and its text a user turn, in the order of its blocks; an assistant turn's
    text, calls and thinking one assistant message; a system turn a system message where it
    stands. Kept in place, a system turn leaves the conversation before it unchanged, so the
    radix cache still holds that prefix on the next request; a chat template that takes a system
    message only first gets them all joined into the first (tokenizer/loader.py's chat_prompt).
    A last assistant turn with no text and no calls asks for the reply as if it were absent."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": req.system if isinstance(req.system, str)
                    else "\n".join(b.text for b in req.system)})
    for msg in req.messages:
        blocks = [TextBlock(type="text", text=msg.content)] if isinstance(msg.content, str) else msg.content
        if msg.role == "system":  # (text blocks only: InputMessage)
            out.append({"role": "system", "content": "\n".join(b.text for b in blocks)})
            continue
        if msg.role == "assistant":
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            turn: dict[str, Any] = {"role": "assistant", "content": text or None}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if calls:
                turn["tool_calls"] = calls
            thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thought:
                turn["reasoning_content"] = thought
            out.append(turn)
            continue
        texts: list[str] = []
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text})
            elif isinstance(b, (TextBlock, DocumentBlock, SearchResultBlock)):
                texts.append(b.text)
        if texts or not blocks:
            out.append({"role": "user", "content": "\n".join(texts)})
    last = out[-1] if out else {}
    if last.get("role") == "assistant" and not (last["content"] or "").strip() and not last.get("tool_calls"):
        out.pop()  # (no text to continue: the reply is written anew, its thinking with it)
    return out


# -------------------------------------------------------------- the answer


def stop_reason(finish: str | None, matched: Any, stops: list[str] | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason, SGLang's matched_stop, and whether the
    model called a tool (a forced call too: Anthropic says tool_use for it, where OpenAI says stop)."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stops or ()):  # (a call it cut short is no use)
        return "stop_sequence", matched
    if called or finish == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's thinking, text and calls as content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append(_tool_use(call["function"]["name"], _tool_input(call["function"]["arguments"])))
    return blocks


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's input: its arguments, or ``{}`` where max_tokens or a stop sequence cut them short,
    as Anthropic's API answers such a tool_use (a stream has sent what there was, as
    ``input_json_delta``)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": new_id("toolu"), "name": name, "input": arguments}


def message_shell(model: str) -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None}


def whole_message(req: MessagesRequest, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("matched_stop"), req.stop_sequences,
                                   bool(choice["message"].get("tool_calls")))
    return {**message_shell(model), "content": content_blocks(choice["message"]), "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(chat["usage"])}


# --------------------------------------------------------------- streaming


class EventStream:
    """One streamed message: chat deltas (``reasoning_content``, ``content``, ``tool_calls`` as
    ToolStream makes them) in, Messages events out as SSE bytes. One content block is open at a
    time; a delta of another kind closes it and opens the next, numbered in order."""

    def __init__(self, req: MessagesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.index = -1  # the open block's, or the last closed one's
        self.open: str | None = None  # the open block's kind

    def start(self, prompt_tokens: int, cached: int) -> bytes:
        message = {**message_shell(self.model), "usage": usage({
            "prompt_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": cached}})}
        return self._event("message_start", message=message) + self._event("ping")

    def feed(self, deltas: list[dict[str, Any]]) -> bytes:
        out = b""
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                out += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                if call.get("id"):  # a new call: its first delta names it
                    out += self._close() + self._open("tool_use", {**_tool_use(call["function"]["name"], {})})
                if args := call["function"].get("arguments"):
                    out += self._event("content_block_delta", index=self.index,
                                       delta={"type": "input_json_delta", "partial_json": args})
        return out

    def finish(self, finish: str | None, matched: Any, usage_: dict[str, Any], called: bool) -> bytes:
        reason, sequence = stop_reason(finish, matched, self.req.stop_sequences, called)
        return (self._close()
                + self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                              usage=usage(usage_))
                + self._event("message_stop"))

    def fail(self, message: str, status: int) -> bytes:
        """The last event of a stream that broke after it started."""
        return self._event("error", **{k: v for k, v in error_body(message, status).items() if k != "type"})

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        out = b""
        if self.open != kind:
            start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            out += self._close() + self._open(kind, start)
        return out + self._event("content_block_delta", index=self.index, delta=delta)

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.open = kind
        return self._event("content_block_start", index=self.index, content_block=block)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":  # its (empty) signature: a local model's reasoning is not signed
            out += self._event("content_block_delta", index=self.index, delta={"type": "signature_delta",
                                                                               "signature": ""})
        self.open = None
        return out + self._event("content_block_stop", index=self.index)

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
