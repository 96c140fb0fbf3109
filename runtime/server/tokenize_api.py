"""``POST /tokenize`` and ``POST /detokenize``, in the shapes vLLM's and llama.cpp's servers use,
answered by the tokenizer process (no model step).

* ``/tokenize``: vLLM's ``{"prompt", "add_special_tokens" (default true: the ids a text prompt is
  fed as), "return_token_strs"}`` or ``{"messages", "tools", "chat_template_kwargs",
  "add_generation_prompt" (default true), "continue_final_message"}`` (rendered as a chat
  request's prompt is) -> ``{"count", "max_model_len", "tokens", "token_strs"}`` (the vocabulary's
  strings); llama.cpp's ``{"content", "add_special" (default false), "with_pieces"}`` ->
  ``{"tokens"}`` (with pieces, ``[{"id", "piece"}]``, each piece the token's text, or its bytes
  where they are not UTF-8 alone, as llama.cpp's).
* ``/detokenize``: ``{"tokens": [ids]}`` -> the text, under vLLM's key (``prompt``) and llama.cpp's
  (``content``) both.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from radixlm.runtime.server.http_common import HTTPError, json_body
from radixlm.runtime.server.openai_api import parse_request
from radixlm.runtime.server.openai_protocol import ChatCompletionRequest
from radixlm.runtime.server.openai_to_native import chat_messages
from radixlm.runtime.server.server_state import ServerState

TOKENIZE_BODY = {"type": "object", "properties": {
    "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"},
    "messages": {"type": "array", "items": {"type": "object"}}, "tools": {"type": "array", "items": {"type": "object"}},
    "chat_template_kwargs": {"type": "object"}, "add_generation_prompt": {"type": "boolean"},
    "continue_final_message": {"type": "boolean"},
    "content": {"type": "string"}, "add_special": {"type": "boolean"}, "with_pieces": {"type": "boolean"},
    "model": {"type": "string"}}}
DETOKENIZE_BODY = {"type": "object", "properties": {"tokens": {"type": "array", "items": {"type": "integer"}},
                                                    "model": {"type": "string"}}, "required": ["tokens"]}


def add_tokenize_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await json_body(request)
        llama_cpp = "content" in body
        args = _tokenize_args(body, llama_cpp)
        out = await _ask(state, "tokenize", args)
        ids = out["input_ids"]
        if llama_cpp:
            if body.get("with_pieces"):
                return {"tokens": [{"id": i, "piece": p} for i, p in zip(ids, out["pieces"])]}
            return {"tokens": ids}
        return {"count": len(ids), "max_model_len": state.info.get("context_length"), "tokens": ids,
                "token_strs": out.get("pieces")}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await json_body(request)
        out = await _ask(state, "detokenize", {"ids": body.get("tokens")})
        return {"prompt": out["text"], "content": out["text"]}


def _tokenize_args(body: dict[str, Any], llama_cpp: bool) -> dict[str, Any]:
    if llama_cpp:
        if not isinstance(body["content"], str):
            raise HTTPError("content must be a string")
        return {"text": body["content"], "add_special_tokens": _flag(body, "add_special", False),
                "pieces": "text" if _flag(body, "with_pieces", False) else None}
    pieces = "tokens" if _flag(body, "return_token_strs", False) else None
    if body.get("messages") is not None:
        prefill = _flag(body, "continue_final_message", False)
        if prefill and body.get("add_generation_prompt") is True:  # (as vLLM refuses it)
            raise HTTPError("continue_final_message and add_generation_prompt cannot both be true")
        template_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, dict):
            raise HTTPError("chat_template_kwargs must be an object")
        template_kwargs = dict(template_kwargs)
        if prefill:  # the last (assistant) message left open, as a chat request's is
            template_kwargs["continue_final_message"] = True
        # the messages as a chat request reads them (text parts, tool calls, developer -> system)
        chat = parse_request(ChatCompletionRequest, {"model": "-", "messages": body["messages"],
                                                     "tools": body.get("tools")})
        try:
            messages = chat_messages(chat)
        except ValueError as e:
            raise HTTPError(str(e)) from None
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()] or None
        return {"messages": messages, "tools": tools, "chat_template_kwargs": template_kwargs or None,
                "add_generation_prompt": _flag(body, "add_generation_prompt", not prefill), "pieces": pieces}
    if not isinstance(body.get("prompt"), str):
        raise HTTPError("give a string prompt (or messages, or llama.cpp's content) to tokenize")
    return {"text": body["prompt"], "add_special_tokens": _flag(body, "add_special_tokens", True), "pieces": pieces}


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise HTTPError(f"{key} must be a boolean")
    return value


async def _ask(state: ServerState, op: str, args: dict[str, Any]) -> dict[str, Any]:
    out = await state.client.control(op, args)
    if "error" in out:
        raise HTTPError(out["error"], out.get("status", 400))
    return out
