"""The OpenAI requests as native calls: the native ``/generate`` body of a completions request
(``completion_to_generate``) or of a chat request (``chat_to_generate``; its messages as a chat
template expects them: ``chat_messages``), sampling parameters, stops, logit bias, response
formats and tool choices included. Free of I/O; the request models are in openai_protocol.py.
"""

from __future__ import annotations

import json
from typing import Any

from radixlm.runtime import tool_calls
from radixlm.runtime.reasoning import ReasoningFormat
from radixlm.runtime.server.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, ResponseFormat, StructuredOutputs, TextPart, _OpenAIRequest,
)


def completion_to_generate(req: CompletionRequest) -> dict[str, Any]:
    """The native ``/generate`` body for a completions request.

    ``sampling_params["max_new_tokens"]`` is ``None`` when the client asked
    for no limit: the caller must replace it with the room left in the
    context window, because ``SamplingParams.from_dict`` would read ``None``
    as its own default.
    """
    key = "text" if isinstance(req.prompt, str) or isinstance(req.prompt[0], str) else "input_ids"
    body: dict[str, Any] = {key: req.prompt, "sampling_params": _sampling_params(req, req.max_tokens),
                            "stream": req.stream, **_vllm_options(req)}
    # token ids are echoed as the runtime decodes them: the texts of the prompt's logprob entries
    if req.logprobs is not None or (req.echo and key == "input_ids") or body.get("logprob_start_len") == 0:
        body["return_logprob"] = True
        body["top_logprobs_num"] = max(req.logprobs or 0, req.prompt_logprobs or 0)
        body["return_text_in_logprobs"] = True
        if req.echo:
            body["logprob_start_len"] = 0  # echoed prompt tokens get logprobs too
    return body


def _vllm_options(req: _OpenAIRequest) -> dict[str, Any]:
    """The native fields of vLLM's request options: the prompt's ids returned, its logprobs from
    the first token (prompt_logprobs; none computed for a stream, which cannot carry them), its
    truncation."""
    body: dict[str, Any] = {}
    if req.return_token_ids:
        body["return_prompt_token_ids"] = True
    if req.prompt_logprobs is not None and not req.stream:
        body.update(return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)
    if req.truncate_prompt_tokens is not None:
        body["truncate_prompt_tokens"] = req.truncate_prompt_tokens
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
    body: dict[str, Any] = {"text": prompt_text, "sampling_params": params, "stream": req.stream, **_vllm_options(req)}
    if tools:
        body["tools"] = tools  # the chat template shows them to the model
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.continue_final_message:  # the tokenizer process renders the messages: it is told there
        template_kwargs["continue_final_message"] = True
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    if reasoning is not None and reasoning.thinking(req.chat_template_kwargs):
        body["require_reasoning"] = True
    if reasoning is not None and reasoning.special_tokens and req.skip_special_tokens is None:
        params["skip_special_tokens"] = False  # gpt-oss's channels are special tokens: kept to be read
    if req.logprobs or body.get("return_logprob"):
        body["return_logprob"] = True
        body["top_logprobs_num"] = max(req.top_logprobs or 0, req.prompt_logprobs or 0)
        body["return_text_in_logprobs"] = True  # (the texts OpenAI's entries and vLLM's decoded_token hold)
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
        "stop_regex": req.stop_regex,
    }
    # Absent fields stay absent so the engine's defaults apply.
    params.update({k: v for k, v in passed.items() if v is not None})
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.logit_bias:
        params["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if req.structured_outputs is not None:
        params.update(_structured_outputs(req.structured_outputs))
    return params


def _structured_outputs(so: StructuredOutputs) -> dict[str, Any]:
    """vLLM's structured_outputs as the native constraint of the same meaning."""
    if so.json_ is not None:
        return {"json_schema": so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)}
    if so.json_object:
        return {"json_schema": json.dumps({"type": "object"})}
    if so.choice is not None:  # one of the strings, literally
        return {"regex": "(" + "|".join(_literal(c) for c in so.choice) + ")"}
    if so.grammar is not None:
        return {"ebnf": so.grammar}
    if so.structural_tag is not None:
        return {"structural_tag": so.structural_tag}
    return {"regex": so.regex}


def _literal(text: str) -> str:
    """`text` as a regex that matches it alone (only the metacharacters escaped: every grammar
    backend reads these, where re.escape's escaped spaces are not standard)."""
    return "".join("\\" + c if c in _REGEX_SPECIALS else c for c in text)


_REGEX_SPECIALS = frozenset("\\.^$*+?{}[]|()")


def _response_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    # A json_schema without a schema body still promises JSON: any object.
    return json.dumps(fmt.json_schema.schema_ or {"type": "object"})
