"""Messages between the runtime's parts, grouped by the process that receives them.

Plain dataclasses of plain values: `radixlm.runtime.ipc` sends them as orjson (never
pickle), tagged with their class name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.sampling_params import SamplingParams

# ---- to the tokenizer process (from clients) ---------------------------------------------------


@dataclass
class GenerateRequest:
    """One prompt from a client. Exactly one of text, input_ids, messages (chat) is set;
    batches and n > 1 are expanded by the client into one request each."""

    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # applied with the model's chat template
    tools: list[dict[str, Any]] | None = None  # with messages: the functions the model may call
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: extra template variables
    require_reasoning: bool = False  # the output begins with reasoning: a constraint starts after it
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False  # logprob entries become [logprob, id, text]
    stream: bool = False
    embed: str | None = None  # "last" or "mean": the prompt's final hidden states pooled (/encode), no output
    lora_path: str | None = None  # the LoRA adapter (by name) the request runs on; None: the base model
    return_prompt_token_ids: bool = False  # meta_info gets the prompt's ids (a stream's first output)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many ids (-1: as many as fit)
    # the OpenAI or Anthropic API's `model`: the adapter of that name if one is served when the
    # scheduler takes the request, else the base model (any other name means it)
    model: str | None = None


@dataclass
class AbortRequest:
    rid: str


@dataclass
class ControlRequest:
    """Server-wide operations: model_info, tokenize and detokenize (answered by the tokenizer
    process, `args` their input); the rest by the scheduler's control path (scheduler/control.py:
    load_lora, unload_lora, lora_adapters, update_weights, flush_cache, server_info,
    check_accounting, dashboard)."""

    rid: str
    op: str
    args: dict[str, Any] | None = None


# ---- to clients (from the tokenizer process) ---------------------------------------------------


@dataclass
class ClientOutput:
    """Progress of one request: the text and token ids since the last output.

    `error` is set (with an HTTP-like `status`) when the request was refused."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None
    status: int = 200


@dataclass
class ControlOutput:
    rid: str
    data: dict[str, Any] = field(default_factory=dict)


# ---- to the scheduler process (from the tokenizer process) -------------------------------------


CONSTRAINT_NOT_GIVEN: Any = object()  # a TokenizedRequest made by hand: the scheduler derives its constraint


@dataclass
class TokenizedRequest:
    """A request ready to run (tokenizer/prepare.py makes them from GenerateRequests)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned (-1: none)
    top_logprobs_num: int = 0
    # the reasoning's end tag (--reasoning-parser): a constraint holds only once the output has it
    reasoning_end_ids: list[int] = field(default_factory=list)
    # (kind, text) of the constraint the scheduler compiles and enforces (constrained.grammar's
    # constraint_key of sampling_params) or None: worked out once, by prepare, and carried
    constraint: tuple[str, str] | None = CONSTRAINT_NOT_GIVEN
    embed: str | None = None  # the prompt's hidden states pooled ("last", "mean") instead of an output
    lora_path: str | None = None  # a LoRA adapter's name (the scheduler refuses one it does not serve)
    model: str | None = None  # GenerateRequest's: an adapter's name, or any other (the base model)

    def __post_init__(self) -> None:
        if isinstance(self.constraint, list):  # JSON has no tuples (ipc); a key must be hashable
            self.constraint = tuple(self.constraint)


# AbortRequest and ControlRequest travel on to the scheduler unchanged.

# ---- to the tokenizer process (from the scheduler process) -------------------------------------


@dataclass
class TokenOutput:
    """What one step produced for one request: new tokens since the last output, and the end if it came."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", "matched"/"length"/"message": ...}
    # how many earlier-reported output tokens new_token_ids replace: jump-forward re-encodes the
    # last tokens together with forced text (the text stays the same, the ids may change)
    replaced: int = 0
    # speculative decoding, so far: verify passes, tokens proposed to them, proposals kept
    spec_verify_ct: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # prompt logprobs come once, with the first output after the prefill
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_ranks: list[int | None] | None = None  # each prompt token's rank where it stands (from 1)
    embedding: list[float] | None = None  # an embedding request's pooled hidden state, at its end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerLimits:
    """Sent once, when the scheduler starts: what requests are checked against, from the model it
    loaded (so the tokenizer process never reads the model's file) and the pool only it knows."""

    kv_pool_tokens: int  # the KV cache pool's size: a longer prompt can never run
    vocab_size: int
    context_length: int  # the model's, capped by --context-length


@dataclass
class BatchTokenOutput:
    """Every request's progress from one scheduler step, in one message."""

    outputs: list[TokenOutput]
