"""Scoring with a generative model: ``POST /v1/score`` (SGLang's) and ``POST /v1/rerank`` (the
Cohere/Jina shape vLLM's and llama.cpp's servers use), by the next-token method of
Qwen3-Reranker-style models.

Both come down to the logprob of given tokens right after a prompt: each (prompt, label) pair is a
prefill-only native request of prompt + label (``max_new_tokens`` 0) asking for the label's prompt
logprob, so the runtime computes only the position before it. The prompts of one call share
their beginning (a query, an instruction), which the radix cache computes once; the pairs of one
prompt share all of it but the label.

* ``/v1/score``: ``query`` and ``items`` (texts, or token ids), ``label_token_ids``; each item's
  probability of each label after query + item (item + query with ``item_first``), or their
  softmax over the labels (``apply_softmax``).
* ``/v1/rerank``: ``query``, ``documents``, ``top_n``, ``instruction``: each document is asked, in
  the model's chat template, whether it meets the query (Qwen3-Reranker's judge prompt, thinking
  off where the template can); its relevance is P(yes) / (P(yes) + P(no)). The results come
  ranked, each with its index and (unless ``return_documents`` is false) its text.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from radixlm.runtime.native import native_requests, native_result
from radixlm.runtime.server.http_common import HTTPError, json_body, run_until_done
from radixlm.runtime.server.openai_api import parse_request
from radixlm.runtime.server.server_state import ServerState, gather_outputs

MAX_ITEMS = 1024
# Qwen3-Reranker's judge: its system prompt, and the user turn it fills in
JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
         'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

Tokens = list[int]


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str | Tokens
    items: list[str] | list[Tokens] = Field(min_length=1, max_length=MAX_ITEMS)
    label_token_ids: list[int] = Field(min_length=1, max_length=64)
    apply_softmax: bool = False
    item_first: bool = False


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | Document] = Field(min_length=1, max_length=MAX_ITEMS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = None


def add_score_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/score")
    async def score(request: Request) -> dict:
        req = parse_request(ScoreRequest, await json_body(request))
        if isinstance(req.query, str) != isinstance(req.items[0], str):
            raise HTTPError("query and items must both be texts or both be token ids")
        prompts = [await _prompt(state, a, b)
                   for a, b in ((i, req.query) if req.item_first else (req.query, i) for i in req.items)]
        logprobs = await run_until_done(request, _label_logprobs(state, prompts, req.label_token_ids))
        scores = [_softmax(lps) if req.apply_softmax else [math.exp(x) for x in lps] for lps in logprobs]
        return {"object": "scoring", "model": state.model_name, "scores": scores,
                "usage": _usage(prompts)}

    @app.post("/v1/rerank")
    async def rerank(request: Request) -> dict:
        req = parse_request(RerankRequest, await json_body(request))
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        instruction = req.instruction or DEFAULT_INSTRUCTION
        prompts = [await _chat_ids(state, [
            {"role": "system", "content": JUDGE},
            {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {req.query}\n<Document>: {doc}"}])
            for doc in texts]
        yes, no = await _one_token(state, "yes"), await _one_token(state, "no")
        logprobs = await run_until_done(request, _label_logprobs(state, prompts, [yes, no]))
        relevance = [_softmax(lps)[0] for lps in logprobs]
        order = sorted(range(len(texts)), key=lambda i: -relevance[i])[: req.top_n]
        results = [{"index": i, "relevance_score": relevance[i],
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "results": results,
                "usage": {"total_tokens": _usage(prompts)["prompt_tokens"]}}


async def _label_logprobs(state: ServerState, prompts: list[Tokens], labels: list[int]) -> list[list[float]]:
    """logprob(label | prompt) of every label after every prompt."""
    vocab = state.info["vocab_size"]  # (the runtime's facts, reported once at start)
    if not all(0 <= t < vocab for t in labels):
        raise HTTPError(f"label_token_ids must lie in [0, {vocab})")
    if not all(prompts):
        raise HTTPError("a prompt to score is empty (the query and the item are both empty)")
    pairs = [(p, t) for p in prompts for t in labels]
    reqs, _ = native_requests({"input_ids": [p + [t] for p, t in pairs], "return_logprob": True,
                               "logprob_start_len": [len(p) for p, _ in pairs],
                               "sampling_params": {"max_new_tokens": 0}})
    outs = [native_result(o) for o in await gather_outputs(state.client, reqs)]
    flat = [o["meta_info"]["input_token_logprobs"][-1][0] for o in outs]
    return [flat[i : i + len(labels)] for i in range(0, len(flat), len(labels))]


async def _prompt(state: ServerState, first: str | Tokens, second: str | Tokens) -> Tokens:
    """The ids of one pair: token ids as they are; texts joined and tokenized as a text prompt is
    (with its tokenizer's special tokens, as SGLang tokenizes the joined text)."""
    if not isinstance(first, str):
        return list(first) + list(second)
    return (await _tokenize(state, {"text": first + second, "add_special_tokens": True}))["input_ids"]


async def _ids(state: ServerState, text: str) -> Tokens:
    return (await _tokenize(state, {"text": text, "add_special_tokens": False}))["input_ids"]


async def _chat_ids(state: ServerState, messages: list[dict[str, str]]) -> Tokens:
    return (await _tokenize(state, {"messages": messages,
                                    "chat_template_kwargs": {"enable_thinking": False}}))["input_ids"]


async def _one_token(state: ServerState, word: str) -> int:
    ids = await _ids(state, word)
    if len(ids) != 1:
        raise HTTPError(f"this model's tokenizer writes {word!r} as {len(ids)} tokens; /v1/rerank asks for one "
                        "(use /v1/score with label_token_ids)")
    return ids[0]


async def _tokenize(state: ServerState, args: dict[str, Any]) -> dict[str, Any]:
    out = await state.client.control("tokenize", args)
    if "error" in out:
        raise HTTPError(out["error"], out.get("status", 400))
    return out


def _softmax(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    return [w / sum(weights) for w in weights]


def _usage(prompts: list[Tokens]) -> dict[str, int]:
    tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
