"""Native results back into the OpenAI API's JSON: whole objects (``completion_response``,
``chat_response``), streamed chunks (``completion_chunk``, ``chat_chunk``, ``usage_chunk``), their
logprobs, usage, finish reasons and SGLang's ``matched_stop``, request ids, and ``openai_error``.
Free of I/O.

Native results are prompt-major: with ``p`` prompts and ``n`` choices each,
choice ``j`` of prompt ``i`` is ``results[i * n + j]``.

Aborted results have no OpenAI finish reason ("abort" is not in the spec and
"stop" would hide a server error), so the builders raise ``RequestAborted``
and the caller answers with an ``openai_error`` instead.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from radixlm.runtime.server.output_readers import ReasoningReader, ToolReader

# OpenAI's stand-in for a logprob too small to print; JSON has no -Infinity.
MIN_LOGPROB = -9999.0

Decode = Callable[[int], str]


class RequestAborted(RuntimeError):
    """A native result finished with ``{"type": "abort"}``; carries its message."""


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


def matched_stop(native: dict[str, Any] | None) -> int | str | None:
    """SGLang's ``matched_stop`` for a native ``meta_info["finish_reason"]``: what stopped the
    choice, the stop string (or stop regex) or the stop token id (EOS included); ``None`` while it
    runs and when a length limit ended it."""
    return native.get("matched") if native is not None else None


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
    vllm: VllmOptions | None = None,
) -> dict[str, Any]:
    """A whole ``text_completion`` object from finished native results.

    ``echo_prompts`` holds the prompt text per prompt when the client set
    ``echo``; echoed text (and, with ``logprobs``, its token logprobs, which
    need ``logprob_start_len=0``) precedes each choice's output. ``vllm``:
    each choice's ids and prompt logprobs, as vLLM puts them in it.
    """
    choices = []
    for index, result in enumerate(results):
        prefix = "" if echo_prompts is None else echo_prompts[index // n]
        meta = result["meta_info"]
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(meta, tokenizer_decode, echo=echo_prompts is not None, top=logprobs)
        choices.append({
            "index": index,
            "text": prefix + result["text"],
            "logprobs": lp,
            "finish_reason": openai_finish_reason(meta["finish_reason"]),
            "matched_stop": matched_stop(meta["finish_reason"]),
            **(vllm.prompt_fields(result) | vllm.output_fields(result) if vllm else {}),
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
    vllm: VllmOptions | None = None,
) -> dict[str, Any]:
    """A whole ``chat.completion`` object; ``results`` are the choices of one prompt.
    With ``reasoning``, each choice's reasoning goes to ``reasoning_content`` (null when it has
    none); with ``tools``, the rest (the content) is read for tool calls. ``vllm``: the echoed
    message before each content, the ids and prompt logprobs (the prompt's beside the choices)."""
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
        if vllm is not None and vllm.echo:
            message["content"] = vllm.echo + (message["content"] or "")
        choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(meta, top_logprobs, tokenizer_decode) if logprobs else None,
            "finish_reason": finish,
            "matched_stop": matched_stop(meta["finish_reason"]),
            **(vllm.output_fields(result) if vllm else {}),
        })
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": aggregate_usage(results, len(results)),
        **(vllm.prompt_fields(results[0]) if vllm and results else {}),
    }


@dataclass
class VllmOptions:
    """What vLLM's request options add to an answer: `return_token_ids` (each choice's output ids,
    and the prompt's), `prompt_logprobs` (that many alternatives per prompt token), chat's `echo`
    (the last message's text, when it is the assistant's, before the reply's content)."""

    token_ids: bool = False
    prompt_logprobs: int | None = None
    echo: str | None = None

    def output_fields(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"token_ids": result["output_ids"]} if self.token_ids else {}

    def prompt_fields(self, result: dict[str, Any]) -> dict[str, Any]:
        """The prompt's ids and logprobs (`result`: a choice of the prompt)."""
        out: dict[str, Any] = {}
        if self.token_ids:
            out["prompt_token_ids"] = result.get("prompt_token_ids")
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(result["meta_info"], self.prompt_logprobs)
        return out


def prompt_logprobs(meta: dict[str, Any], top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (from the first, which has none: null), the
    token itself and the ``top`` most likely tokens there, by id, each with its logprob, its
    rank (the tokens at least as likely there, itself included, as vLLM counts) and its text
    (``decoded_token``)."""
    entries = meta.get("input_token_logprobs") or []
    tops = _padded(meta.get("input_top_logprobs"), len(entries))
    ranks = _padded(meta.get("input_token_ranks"), len(entries))
    out: list[dict[str, dict[str, Any]] | None] = []
    for (logprob, token_id, text), alternatives, own_rank in zip(entries, tops, ranks):
        if logprob is None:
            out.append(None)
            continue
        ranked = [(lp, tid, tx, rank) for rank, (lp, tid, tx) in enumerate(alternatives or [], 1)]
        own = next((r for r in ranked if r[1] == token_id), (logprob, token_id, text, own_rank))
        out.append({str(tid): {"logprob": _finite(lp), "rank": rank, "decoded_token": tx}
                    for lp, tid, tx, rank in [own, *ranked[:top]]})
    return out


def completion_logprobs(
    meta: dict[str, Any], decode: Decode, *, echo: bool = False, text_offset: int = 0, top: int | None = None
) -> dict[str, Any]:
    """The completions ``logprobs`` object for one (possibly partial) result.

    ``text_offset`` indexes each token within the choice's ``text`` (echoed
    prompt included); a stream passes the length sent so far. Offsets sum
    decoded token lengths, so they drift where a token alone decodes
    differently than in context. With ``echo`` the first prompt token has no
    logprob and no alternatives: ``null``, as OpenAI sends it. Each other
    token's alternatives include the token itself, as OpenAI's and the peers'
    do: ``logprobs: 0`` gives one entry, ``logprobs: k`` up to k + 1 (``top``:
    k, where the runtime returned more for prompt_logprobs).
    """
    pairs = list(meta.get("output_token_logprobs") or [])
    tops = _padded(meta.get("output_top_logprobs"), len(pairs))
    if echo:
        prompt_pairs = meta.get("input_token_logprobs") or []
        pairs = prompt_pairs + pairs
        tops = _padded(meta.get("input_top_logprobs"), len(prompt_pairs)) + tops
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for (logprob, token_id, *_), alternatives in zip(pairs, tops):
        alternatives = alternatives or []
        token = decode(token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        token_logprobs.append(None if logprob is None else _finite(logprob))
        if logprob is None:
            top_logprobs.append(None)
        else:  # up to logprobs + 1 entries: the token itself is always among them (logprobs=0 too)
            top_logprobs.append(_top_dict(alternatives[:top], decode))
            top_logprobs[-1].setdefault(token, _finite(logprob))
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
    matched: int | str | None = None,
) -> dict[str, Any]:
    """One streamed completions event; ``finish_reason`` is already OpenAI's, ``matched`` its
    ``matched_stop``."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "matched_stop": matched}
    return _chunk(f"cmpl-{request_id}", "text_completion", model, created, [choice])


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    matched: int | str | None = None,
) -> dict[str, Any]:
    """One streamed chat event; the first ``delta`` of a choice carries ``role``, the last its
    ``finish_reason`` and ``matched_stop`` (``matched``)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              "matched_stop": matched}
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
