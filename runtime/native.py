"""SGLang's native generate body, turned into one GenerateRequest per generation.

Shared by the HTTP server's /generate (and its OpenAI endpoints) and by `Engine`.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Any, Sequence

from radixlm.runtime.messages import ClientOutput, GenerateRequest
from radixlm.runtime.sampling_params import sample_seed

MAX_BATCH = 1024  # prompts x n in one call


class BadRequest(ValueError):
    """The body is malformed; the message says what was wrong."""


NATIVE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "rid", "messages", "tools"}


_INT, _NUM, _BOOL, _STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}
_TOKENS = {"type": "array", "items": _INT}
SAMPLING_PARAMS_SCHEMA = {
    "type": "object",
    "properties": {
        **dict.fromkeys(("max_new_tokens", "min_new_tokens", "top_k", "n", "seed"), _INT),
        **dict.fromkeys(("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                         "presence_penalty"), _NUM),
        **dict.fromkeys(("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"), _BOOL),
        **dict.fromkeys(("regex", "json_schema", "dtype", "choices_method", "structural_tag"), _STR),
        "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        "stop_token_ids": _TOKENS,
        "logit_bias": {"type": "object", "additionalProperties": _NUM},
        "choices": {"type": "array", "items": _STR},
    },
    "additionalProperties": False,
}
# The /generate body, for the OpenAPI document (native_requests checks it, with messages that
# name the problem).
GENERATE_BODY_SCHEMA = {
    "type": "object",
    "properties": {
        "text": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        "input_ids": {"anyOf": [_TOKENS, {"type": "array", "items": _TOKENS}]},
        "messages": {"type": "array", "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}},  # OpenAI's shape, shown by the chat template
        "sampling_params": {"anyOf": [SAMPLING_PARAMS_SCHEMA, {"type": "array", "items": SAMPLING_PARAMS_SCHEMA}]},
        **dict.fromkeys(("stream", "return_logprob", "return_text_in_logprobs"), _BOOL),
        **dict.fromkeys(("logprob_start_len", "top_logprobs_num"), _INT),
        "rid": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
    },
    "additionalProperties": False,
}
assert set(GENERATE_BODY_SCHEMA["properties"]) == NATIVE_FIELDS


def native_requests(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
    """Expand a native /generate body into one GenerateRequest per prompt and sample (n)."""
    unknown = sorted(set(body) - NATIVE_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(NATIVE_FIELDS)}")
    text, ids, chat = body.get("text"), body.get("input_ids"), body.get("messages")
    if sum(x is not None for x in (text, ids, chat)) != 1:
        raise BadRequest("give exactly one of 'text', 'input_ids' or 'messages'")
    tools = body.get("tools")
    if tools is not None and (chat is None or not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise BadRequest("'tools' goes with 'messages': a list of {\"type\": \"function\", \"function\": {\"name\", ...}}")
    prompts, single = _prompts(text, ids, chat)
    params = body.get("sampling_params") or {}
    param_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(param_list) != len(prompts) or not all(isinstance(p, dict) for p in param_list):
        raise BadRequest("'sampling_params' must be an object or a list of objects, one per prompt")
    rids = body.get("rid")
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, param_list)):
        n = p.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise BadRequest("sampling_params.n must be an integer >= 1")
        if len(reqs) + n > MAX_BATCH:  # checked before expanding: n may be huge
            raise BadRequest(f"more than {MAX_BATCH} generations (prompts x n) in one call")
        base = _rid(rids, i, single)
        for j in range(n):
            rid = base if n == 1 else f"{base}-{j}"
            reqs.append(GenerateRequest(
                rid=rid,
                text=prompt if isinstance(prompt, str) else None,
                input_ids=prompt if ids is not None else None,
                messages=prompt if chat is not None else None,
                tools=tools,
                sampling_params=_sample_params(p, j),
                return_logprob=bool(body.get("return_logprob", False)),
                logprob_start_len=_int(body, "logprob_start_len", -1),
                top_logprobs_num=_int(body, "top_logprobs_num", 0),
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                stream=bool(body.get("stream", False)),
            ))
    return reqs, single and len(reqs) == 1


def _sample_params(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The sampling params of sample `index` of n: a seed gives each sample its own stream."""
    out = {k: v for k, v in params.items() if k != "n"}
    seed = out.get("seed")
    if index and isinstance(seed, int) and not isinstance(seed, bool):
        out["seed"] = sample_seed(seed, index)
    return out


def _prompts(text: Any, ids: Any, chat: Any) -> tuple[list[Any], bool]:
    """The body's prompts, and whether it held one (not a batch)."""
    if chat is not None:  # one chat conversation
        if not isinstance(chat, list) or not chat or not all(isinstance(m, dict) for m in chat):
            raise BadRequest("'messages' must be a non-empty list of message objects")
        return [chat], True
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return text, False
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    if _is_token_ids(ids):
        return [ids], True
    if isinstance(ids, list) and ids and all(_is_token_ids(p) for p in ids):
        return ids, False
    raise BadRequest("'input_ids' must be a list of token ids (integers) or a non-empty list of such lists")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _rid(rids: Any, i: int, single: bool) -> str:
    if isinstance(rids, str) and single:
        return rids
    if isinstance(rids, list) and i < len(rids) and isinstance(rids[i], str):
        return rids[i]
    return uuid.uuid4().hex


def _int(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{key}' must be an integer")
    return value


def native_result(out: ClientOutput) -> dict[str, Any]:
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": out.meta_info}


class GenerateAPI(ABC):
    """`generate(...)` of the Python engines, as a native body: both engines take the same
    arguments and return the same shapes as /generate."""

    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One prompt -> a dict; a batch -> a list (n > 1: n per prompt, prompt-major). Each result
        has `text`, `output_ids` and `meta_info` (id, prompt/completion/cached tokens,
        finish_reason and, when asked, logprobs). Raises ValueError for refused input."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        if prompt is not None:
            body["text"] = prompt if isinstance(prompt, str) else list(prompt)
        if input_ids is not None:
            batch = bool(input_ids) and not isinstance(input_ids[0], int)
            body["input_ids"] = [list(x) for x in input_ids] if batch else list(input_ids)
        reqs, single = native_requests(body)
        results = self._run_requests(reqs)
        return results[0] if single else results

    @abstractmethod
    def _run_requests(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        """Run every request to the end; results in order, in native_result's shape."""
