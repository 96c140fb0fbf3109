"""The OpenAI-compatible API's request models: what a client sends to ``/v1/completions`` and
``/v1/chat/completions``, parsed and range-checked (``CompletionRequest``,
``ChatCompletionRequest`` and the parts they hold), with the API's limits (``MAX_N``, ...).

The rest of the OpenAI path lives beside it, all free of I/O so the HTTP layer stays thin:
openai_to_native.py turns a request into the native ``/generate`` body, output_readers.py reads
tool calls and reasoning out of a choice's text, and openai_builders.py turns native results
back into OpenAI JSON.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

MAX_N = 16  # choices per prompt; each one is a full sequence in the batch
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_CHAT_TOP_LOGPROBS = 20  # the chat API's limit
MAX_TOOLS = 128  # OpenAI's limit on tools per request

TokenId = Annotated[StrictInt, Field(ge=0)]
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _tool_name(name: str) -> str:
    # OpenAI's limit, and the one Anthropic's tool-use guide documents (^[a-zA-Z0-9_-]{1,64}$):
    # one rule for both APIs, since a Messages tool runs as a chat tool
    if not _TOOL_NAME.fullmatch(name):
        shown = repr(name) if len(name) <= 128 else repr(name[:128]) + "..."
        raise ValueError(f"the tool name {shown} ({len(name)} characters) is not allowed: a tool name is 1 to 64 "
                         "letters, digits, '_' or '-'")
    return name


FunctionName = Annotated[str, AfterValidator(_tool_name)]


# OpenAI request fields that have no effect on a local model server (bookkeeping, billing):
# accepted so that clients sending them work, and ignored.
ACCEPTED_NO_EFFECT = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})


MAX_PROMPT_LOGPROBS = 20  # vLLM's default --max-logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # every chunk with its choice's usage so far (vLLM's, SGLang's)


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one constraint on the output (``json``: a schema, as text or an
    object; ``regex``; ``choice``: one of these strings; ``grammar``: EBNF; ``json_object``: any
    object; ``structural_tag``), and options; those for vLLM's own backends are refused when set."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: str | dict[str, Any] | None = Field(None, alias="json")  # (`json` would shadow BaseModel's)
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False  # no effect: a constraint here never falls back to another backend
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, "json_" if k == "json" else k) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object or structural_tag"
                             + (f", not {' and '.join(given)}" if given else ""))
        options = [k for k in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
                   if getattr(self, k)]
        if options:
            raise ValueError(f"{', '.join(options)} is not supported (an option of vLLM's grammar backends); leave it out")
        return self


class SamplingExtras(BaseModel):
    """Sampling fields that /v1/responses takes too (SGLang's ResponsesRequest has them), beside
    the chat and completions endpoints; passed through as-is, SamplingParams checks the ranges of
    SGLang's own (``top_k``, ``min_p``, ``repetition_penalty``)."""

    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


class _OpenAIRequest(SamplingExtras):
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
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions, passed through as-is; SamplingParams checks their ranges.
    min_tokens: StrictInt | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema as a string (chat also has response_format)
    skip_special_tokens: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    stop_regex: str | list[str] | None = None
    # vLLM's: the token ids beside the text; the prompt's logprobs with this many alternatives;
    # only the prompt's last tokens (-1: as many as the context holds); a constraint
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if (v is not None or k in cls._null_is_meaningful) and k not in ACCEPTED_NO_EFFECT}

    @model_validator(mode="after")
    def _stream_only_options(self) -> _OpenAIRequest:
        # (as OpenAI, vLLM and SGLang refuse them)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs:
            raise ValueError("prompt_logprobs are not available when stream is true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds)")
        formats = [k for k in ("regex", "json_schema", "structured_outputs") if getattr(self, k) is not None]
        if len(formats) > 1:
            raise ValueError(f"{' and '.join(formats)} both constrain the output; give one")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # every bad entry is named, not only the first
        not_ids = [key for key in bias or () if not (key.isascii() and key.isdigit())]
        if not_ids:
            raise ValueError(f"logit_bias keys must be token ids (digit strings), got {', '.join(map(repr, not_ids))}")
        out_of_range = [f"logit_bias[{key}]={value}" for key, value in (bias or {}).items() if not -100 <= value <= 100]
        if out_of_range:
            raise ValueError(f"{', '.join(out_of_range)} out of range; allowed: [-100, 100]")
        return bias

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries its choice's usage so far."""
        return self.stream and self.stream_options is not None and self.stream_options.continuous_usage_stats


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
    def prompts(self) -> list[str | list[int]]:
        """The prompts, texts or token ids, one per entry (one prompt is a list of one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def num_prompts(self) -> int:
        """How many prompts the request holds; results number ``num_prompts * n``."""
        return len(self.prompts)


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
    name: FunctionName
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
    # SGLang's assistant prefill: a last message of the assistant's is continued, not closed
    continue_final_message: bool = False
    # vLLM's: a last message of the assistant's is put before the reply's content
    echo: bool = False

    @model_validator(mode="after")
    def _one_output_format(self) -> ChatCompletionRequest:
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format and structured_outputs both constrain the output; give one")
        return self

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
            formats = [k for k in ("regex", "json_schema", "structured_outputs") if getattr(self, k) is not None]
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
