"""The OpenAI-compatible API's wire format, and its mapping to native calls.

Three parts, all free of I/O so the HTTP layer stays thin:

* request models (``CompletionRequest``, ``ChatCompletionRequest``) that parse
  and range-check what an OpenAI client sends;
* converters (``completion_to_generate``, ``chat_to_generate``,
  ``chat_messages``) into the native ``/generate`` body;
* builders that turn native results back into OpenAI JSON, whole
  (``completion_response``, ``chat_response``) or streamed
  (``completion_chunk``, ``chat_chunk``, ``usage_chunk``), plus
  ``openai_error``.

Native results are prompt-major: with ``p`` prompts and ``n`` choices each,
choice ``j`` of prompt ``i`` is ``results[i * n + j]``.

Aborted results have no OpenAI finish reason ("abort" is not in the spec and
"stop" would hide a server error), so the builders raise ``RequestAborted``
and the caller answers with an ``openai_error`` instead.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from radixlm.runtime import tool_calls
from radixlm.runtime.reasoning import ReasoningFormat, ReasoningStream, Split, reasoning_format, split_reasoning

MAX_N = 16  # choices per prompt; each one is a full sequence in the batch
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_CHAT_TOP_LOGPROBS = 20  # the chat API's limit
MAX_TOOLS = 128  # OpenAI's limit on tools per request
# OpenAI's stand-in for a logprob too small to print; JSON has no -Infinity.
MIN_LOGPROB = -9999.0

TokenId = Annotated[StrictInt, Field(ge=0)]
Decode = Callable[[int], str]


class RequestAborted(RuntimeError):
    """A native result finished with ``{"type": "abort"}``; carries its message."""


# ---------------------------------------------------------------- requests


# OpenAI request fields that have no effect on a local model server (bookkeeping, billing):
# accepted so that clients sending them work, and ignored.
ACCEPTED_NO_EFFECT = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    """Shared parsing rules of both endpoints.

    An unknown field is refused (400 naming it), as OpenAI does: a misspelt
    ``max_token`` must not silently fall back to the default. OpenAI fields
    that change nothing here (``ACCEPTED_NO_EFFECT``) are accepted and dropped.
    JSON ``null`` means "use the default" except for the fields in
    ``_null_is_meaningful``.
    """

    model_config = ConfigDict(extra="forbid")
    _null_is_meaningful: ClassVar[frozenset[str]] = frozenset()

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions, passed through as-is; SamplingParams checks their ranges.
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema as a string (chat also has response_format)
    skip_special_tokens: bool | None = None
    stop_token_ids: list[TokenId] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if (v is not None or k in cls._null_is_meaningful) and k not in ACCEPTED_NO_EFFECT}

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (digit strings), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{key}]={value} is out of range; allowed: [-100, 100]")
        return bias

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIRequest):
    """Body of ``POST /v1/completions``."""

    # An explicit null asks for "as many as fit", unlike an absent field (16).
    _null_is_meaningful: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must be non-empty: got an empty list of prompts or of token ids")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, suffix: str | None) -> None:
        if suffix is not None:
            raise ValueError("suffix is not supported (no fill-in-the-middle); omit it")

    @field_validator("best_of")
    @classmethod
    def _reject_best_of(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of != 1:
            raise ValueError(f"best_of={best_of} is not supported; allowed: 1 (use n for several choices)")
        return best_of

    @property
    def num_prompts(self) -> int:
        """How many prompts the request holds; results number ``num_prompts * n``."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return 1
        return len(p)


class TextPart(BaseModel):
    """One part of a message's content; only ``type == "text"`` is supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(BaseModel):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers
    reasoning_content: str | None = None  # assistant turns: their reasoning, for templates that show it

    @model_validator(mode="after")
    def _tool_turns_answer_a_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolName


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    # `schema` would shadow a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format type "json_schema" needs a json_schema object')
        return self


class ChatCompletionRequest(_OpenAIRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # SGLang's: variables for the chat template (Qwen3's enable_thinking); under --reasoning-parser,
    # the reasoning as reasoning_content (separate_reasoning), streamed as it comes or in one delta
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be distinct")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        strict = self.tool_mode == "auto" and any(t.function.strict for t in self.tools or ())
        if self.tool_mode in ("required", "named") or strict:
            formats = [k for k in ("regex", "json_schema") if getattr(self, k) is not None]
            if self.response_format is not None and self.response_format.type != "text":
                formats.append("response_format")
            if formats:
                what = "a forced tool call fixes" if not strict else "strict tools under tool_choice auto constrain"
                raise ValueError(f"{what} the output's form; it cannot be combined with {' or '.join(formats)}")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools shape the output: OpenAI's default is "auto" with tools, else "none"."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens`` (the current name) wins over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# -------------------------------------------------------------- conversions


def completion_to_generate(req: CompletionRequest) -> dict[str, Any]:
    """The native ``/generate`` body for a completions request.

    ``sampling_params["max_new_tokens"]`` is ``None`` when the client asked
    for no limit: the caller must replace it with the room left in the
    context window, because ``SamplingParams.from_dict`` would read ``None``
    as its own default.
    """
    key = "text" if isinstance(req.prompt, str) or isinstance(req.prompt[0], str) else "input_ids"
    body: dict[str, Any] = {key: req.prompt, "sampling_params": _sampling_params(req, req.max_tokens)}
    body["stream"] = req.stream
    if req.logprobs is not None:
        body["return_logprob"] = True
        body["top_logprobs_num"] = req.logprobs
        if req.echo:
            body["logprob_start_len"] = 0  # echoed prompt tokens get logprobs too
    return body


def chat_to_generate(req: ChatCompletionRequest, prompt_text: str,
                     reasoning: ReasoningFormat | None = None) -> dict[str, Any]:
    """The native body for a chat request whose messages rendered to ``prompt_text``; with the
    server's ``reasoning`` format, a constraint waits for the reasoning to end when it thinks.

    The same ``max_new_tokens=None`` caveat as ``completion_to_generate`` holds.
    """
    params = _sampling_params(req, req.output_limit)
    schema = _response_schema(req.response_format)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    if req.tool_mode == "required":
        schema = tool_calls.required_schema(tools, req.parallel_tool_calls)
    elif req.tool_mode == "named":
        schema = tool_calls.named_schema(next(t for t in tools if t["function"]["name"] == req.tool_choice.function.name))
    elif req.tool_mode == "auto" and (tag := tool_calls.strict_tag(tools)) is not None:
        params["structural_tag"] = tag
    if schema is not None:
        params["json_schema"] = schema
    body: dict[str, Any] = {"text": prompt_text, "sampling_params": params, "stream": req.stream}
    if tools:
        body["tools"] = tools  # the chat template shows them to the model
    if req.chat_template_kwargs:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if reasoning is not None and reasoning.thinking(req.chat_template_kwargs):
        body["require_reasoning"] = True
    if req.logprobs:
        body["return_logprob"] = True
        body["top_logprobs_num"] = req.top_logprobs or 0
    return body


# Chat templates predate OpenAI's "developer" role, which means "system".
_TEMPLATE_ROLE = {"developer": "system"}


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as a chat template expects them: role and plain-text content, and the tool calls
    (arguments as objects) and the ids of the calls that tool turns answer.

    Text parts are joined with newlines; ``developer`` becomes ``system``
    since templates predate it. Raises ``ValueError`` naming any non-text
    part, which this text-only runtime cannot feed to the model, or a past
    call whose arguments are not a JSON object.
    """
    out = []
    for i, msg in enumerate(req.messages):
        entry: dict[str, Any] = {
            "role": _TEMPLATE_ROLE.get(msg.role, msg.role),
            "content": _message_text(i, msg.content),
        }
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        if msg.reasoning_content is not None:
            entry["reasoning_content"] = msg.reasoning_content
        if msg.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(f"messages[{i}].tool_calls[{j}]", c.function.arguments)}}
                for j, c in enumerate(msg.tool_calls)]
        out.append(entry)
    return out


def _arguments(where: str, text: str) -> dict[str, Any]:
    """A past call's arguments as the object chat templates expect."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object (as text); got {text[:80]!r}")
    return args


def _message_text(index: int, content: str | list[TextPart] | None) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    unsupported = sorted({p.type for p in content if p.type != "text"})
    if unsupported:
        raise ValueError(
            f"messages[{index}].content has unsupported part type(s) {', '.join(unsupported)}; "
            'only "text" parts are supported'
        )
    return "\n".join(p.text or "" for p in content)


def _sampling_params(req: _OpenAIRequest, max_new_tokens: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    passed = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "regex": req.regex,
        "json_schema": req.json_schema,
        "skip_special_tokens": req.skip_special_tokens,
        "stop_token_ids": req.stop_token_ids,
    }
    # Absent fields stay absent so the engine's defaults apply.
    params.update({k: v for k, v in passed.items() if v is not None})
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.logit_bias:
        params["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    return params


def _response_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    # A json_schema without a schema body still promises JSON: any object.
    return json.dumps(fmt.json_schema.schema_ or {"type": "object"})


# ---------------------------------------------------------------- tool calls


@dataclass
class ToolReader:
    """Reads a chat choice's tool calls, by the request's ``tool_choice`` (see runtime/tool_calls.py)."""

    mode: Literal["auto", "required", "named"]
    names: set[str]
    parallel: bool
    function: str | None = None  # the named one

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolReader | None:
        mode = req.tool_mode
        if mode == "none":
            return None
        named = req.tool_choice.function.name if mode == "named" else None
        return cls(mode, {t.function.name for t in req.tools or ()}, req.parallel_tool_calls, named)

    def read(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """(content, calls) of a whole choice."""
        if self.mode == "named":  # the text is the arguments (cut short if the length limit struck)
            return None, [tool_calls.ToolCall(self.function, text)]
        # a `required` output is a JSON array of calls, which auto's reading takes as bare calls
        # (cut short by the length limit, it stays content)
        return tool_calls.parse_auto(text, self.names, self.parallel)

    def finish_reason(self, finish: str) -> str:
        """OpenAI says "tool_calls" when the model chose to call, and "stop" when the call was forced by name."""
        return "tool_calls" if finish == "stop" and self.mode != "named" else finish

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice's deltas: content as it can be sent, calls as OpenAI streams them."""

    def __init__(self, reader: ToolReader) -> None:
        self.reader = reader
        # auto and required (bare JSON calls, held to the end)
        self.auto = tool_calls.AutoStream(reader.names, reader.parallel) if reader.mode != "named" else None
        self.named_call: tool_calls.ToolCall | None = None
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.auto is not None:
            content = self.auto.feed(text)
            return [{"content": content}] if content else []
        if self.named_call is None:  # the first delta names the function; the arguments follow in pieces
            self.named_call = tool_calls.ToolCall(self.reader.function, text)
            self.called = True
            return [{"tool_calls": [self.named_call.openai(0)]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        if self.auto is None:
            return self.feed("") if self.named_call is None else []
        content, calls = self.auto.finish()
        deltas = [{"content": content}] if content else []
        if calls:
            self.called = True
            deltas.append({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]})
        return deltas


# ---------------------------------------------------------------- reasoning


@dataclass
class ReasoningReader:
    """Splits a chat choice's reasoning from its content (runtime/reasoning.py), as the request asks."""

    fmt: ReasoningFormat
    thinking: bool  # the output begins inside the reasoning block
    whole: bool = False  # stream the reasoning in one delta, once it has ended

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: str | None) -> ReasoningReader | None:
        if parser is None or not req.separate_reasoning:
            return None
        fmt = reasoning_format(parser)
        return cls(fmt, fmt.thinking(req.chat_template_kwargs), whole=not req.stream_reasoning)

    def split(self, text: str) -> Split:
        return split_reasoning(text, self.fmt, self.thinking)

    def stream(self) -> ReasoningDeltas:
        return ReasoningDeltas(self)


class ReasoningDeltas:
    """One streamed choice's text split into reasoning and content deltas."""

    def __init__(self, reader: ReasoningReader) -> None:
        self.stream = ReasoningStream(reader.fmt, reader.thinking)
        self.whole = reader.whole
        self.thought = ""  # reasoning held back until it ends (``whole``)

    def feed(self, text: str, finished: bool) -> Split:
        part = self.stream.feed(text)
        if finished:
            rest = self.stream.finish()
            part = Split(part.reasoning + rest.reasoning, part.content + rest.content)
        if not self.whole:
            return part
        self.thought += part.reasoning
        if self.stream.in_reasoning and not finished:
            return Split("", part.content)
        thought, self.thought = self.thought, ""
        return Split(thought, part.content)


class ChoiceStream:
    """One streamed chat choice's deltas: ``reasoning_content`` first (with ``reasoning``), then the
    content, read for tool calls (with ``tools``)."""

    def __init__(self, tools: ToolReader | None, reasoning: ReasoningReader | None) -> None:
        self.tools = tools.stream() if tools is not None else None
        self.reasoning = reasoning.stream() if reasoning is not None else None

    @property
    def called(self) -> bool:
        """Whether the model chose to call a tool (so far)."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        deltas = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, finished)
            if thought:
                deltas.append({"reasoning_content": thought})
        if self.tools is None:
            if text or not deltas:
                deltas.append({"content": text})
        else:
            deltas += self.tools.feed(text) + (self.tools.finish() if finished else [])
        return deltas


# -------------------------------------------------------- response builders


def new_request_id() -> str:
    """A fresh id; builders prefix it with ``cmpl-`` or ``chatcmpl-``."""
    return uuid.uuid4().hex


def openai_finish_reason(native: dict[str, Any] | None) -> str | None:
    """OpenAI's finish reason for a native ``meta_info["finish_reason"]``.

    ``None`` (still running) stays ``None``; an abort raises ``RequestAborted``.
    """
    if native is None:
        return None
    kind = native.get("type")
    if kind == "abort":
        raise RequestAborted(native.get("message") or "request aborted")
    if kind in ("stop", "length"):
        return kind
    raise AssertionError(f"unknown native finish reason {native!r}")


def aggregate_usage(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Usage over prompt-major results with ``n`` choices per prompt.

    The ``n`` choices share one prompt, so prompt and cached tokens come from
    each prompt's first choice; its siblings would double-count it (and
    report it as cached, having hit the first one's prefix).
    """
    assert n >= 1 and len(results) % n == 0, (len(results), n)
    metas = [r["meta_info"] for r in results]
    firsts = metas[::n]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in metas)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m.get("cached_tokens", 0) for m in firsts)},
    }


def completion_response(
    results: list[dict[str, Any]],
    model: str,
    request_id: str,
    echo_prompts: list[str] | None,
    logprobs: int | None,
    tokenizer_decode: Decode,
    *,
    n: int,
) -> dict[str, Any]:
    """A whole ``text_completion`` object from finished native results.

    ``echo_prompts`` holds the prompt text per prompt when the client set
    ``echo``; echoed text (and, with ``logprobs``, its token logprobs, which
    need ``logprob_start_len=0``) precedes each choice's output.
    """
    choices = []
    for index, result in enumerate(results):
        prefix = "" if echo_prompts is None else echo_prompts[index // n]
        meta = result["meta_info"]
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(meta, tokenizer_decode, echo=echo_prompts is not None)
        choices.append({
            "index": index,
            "text": prefix + result["text"],
            "logprobs": lp,
            "finish_reason": openai_finish_reason(meta["finish_reason"]),
        })
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": aggregate_usage(results, n),
    }


def chat_response(
    results: list[dict[str, Any]],
    model: str,
    request_id: str,
    logprobs: bool,
    top_logprobs: int,
    tokenizer_decode: Decode,
    tools: ToolReader | None = None,
    reasoning: ReasoningReader | None = None,
) -> dict[str, Any]:
    """A whole ``chat.completion`` object; ``results`` are the choices of one prompt.
    With ``reasoning``, each choice's reasoning goes to ``reasoning_content`` (null when it has
    none); with ``tools``, the rest (the content) is read for tool calls."""
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        text = result["text"]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            thought, text = reasoning.split(text)
            message.update(content=text, reasoning_content=thought or None)
        finish = openai_finish_reason(meta["finish_reason"])
        if tools is not None:
            message["content"], calls = tools.read(text)
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                finish = tools.finish_reason(finish)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(meta, top_logprobs, tokenizer_decode) if logprobs else None,
            "finish_reason": finish,
        })
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": aggregate_usage(results, len(results)),
    }


def completion_logprobs(
    meta: dict[str, Any], decode: Decode, *, echo: bool = False, text_offset: int = 0
) -> dict[str, Any]:
    """The completions ``logprobs`` object for one (possibly partial) result.

    ``text_offset`` indexes each token within the choice's ``text`` (echoed
    prompt included); a stream passes the length sent so far. Offsets sum
    decoded token lengths, so they drift where a token alone decodes
    differently than in context. With ``echo`` the first prompt token has no
    logprob and no alternatives: ``null``, as OpenAI sends it.
    """
    pairs = list(meta.get("output_token_logprobs") or [])
    tops = _padded(meta.get("output_top_logprobs"), len(pairs))
    if echo:
        prompt_pairs = meta.get("input_token_logprobs") or []
        pairs = prompt_pairs + pairs
        tops = _padded(meta.get("input_top_logprobs"), len(prompt_pairs)) + tops
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for (logprob, token_id, *_), top in zip(pairs, tops):
        token = decode(token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        token_logprobs.append(None if logprob is None else _finite(logprob))
        top_logprobs.append(None if logprob is None else _top_dict(top, decode))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(meta: dict[str, Any], top_logprobs: int, decode: Decode) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) for one result."""
    pairs = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(pairs)
    content = []
    for (logprob, token_id, *_), top in zip(pairs, tops):
        entry = _chat_token(logprob, token_id, decode)
        entry["top_logprobs"] = [_chat_token(lp, tid, decode) for lp, tid, *_ in (top or [])[:top_logprobs]]
        content.append(entry)
    return {"content": content}


def _chat_token(logprob: float, token_id: int, decode: Decode) -> dict[str, Any]:
    token = decode(token_id)
    # NOTE: a token holding part of a UTF-8 character decodes to U+FFFD, so
    # its bytes are those of U+FFFD, not the token's raw bytes.
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _padded(tops: list | None, n: int) -> list:
    """Top-logprob entries for n tokens: without top_logprobs the runtime sends fewer (or none)."""
    tops = list(tops or [])
    return tops + [None] * (n - len(tops))


def _top_dict(top: list[list[Any]] | None, decode: Decode) -> dict[str, float]:
    # Distinct ids may decode alike (byte fallbacks); the most likely one wins.
    out: dict[str, float] = {}
    for logprob, token_id, *_ in top or []:
        out.setdefault(decode(token_id), _finite(logprob))
    return out


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


# -------------------------------------------------------------- streaming


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed completions event; ``finish_reason`` is already OpenAI's."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk(f"cmpl-{request_id}", "text_completion", model, created, [choice])


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chat event; the first ``delta`` of a choice carries ``role``."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk(f"chatcmpl-{request_id}", "chat.completion.chunk", model, created, [choice])


def usage_chunk(
    request_id: str, model: str, created: int, usage: dict[str, Any], *, chat: bool
) -> dict[str, Any]:
    """The last event of a stream with ``include_usage``: no choices, only usage."""
    if chat:
        chunk = _chunk(f"chatcmpl-{request_id}", "chat.completion.chunk", model, created, [])
    else:
        chunk = _chunk(f"cmpl-{request_id}", "text_completion", model, created, [])
    chunk["usage"] = usage
    return chunk


def _chunk(id_: str, object_: str, model: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": id_, "object": object_, "created": created, "model": model, "choices": choices}


def openai_error(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: int = 400
) -> dict[str, Any]:
    """An OpenAI error body; ``code`` mirrors the HTTP status the caller sends."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
