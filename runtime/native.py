"""SGLang's native generate body: its contract, and its expansion into GenerateRequests.

Owns what a /generate body may hold (`NATIVE_FIELDS`, `UNSUPPORTED_FIELDS`, the OpenAPI schemas,
the sampling parameters' derived from `SamplingParams`), `native_requests` (one GenerateRequest
per prompt and sample), `native_result` / `CumulativeStream` (the result's shapes), `BadRequest`
(a request refused as it is: 400) and `GenerateAPI`, the `generate(...)` both Python engines
share. Shared by the HTTP server's /generate (and its OpenAI endpoints) and by the engines;
what happens to a GenerateRequest next is tokenizer/prepare.py's.
"""

from __future__ import annotations

import dataclasses
import uuid
from abc import ABC, abstractmethod
from typing import Any, Iterator, Sequence

from radixlm.runtime.messages import ClientOutput, GenerateRequest
from radixlm.runtime.sampling_params import ALIASES, SamplingParams, sample_seed

MAX_BATCH = 1024  # prompts x n in one call


class BadRequest(ValueError):
    """The body is malformed; the message says what was wrong."""


NATIVE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "rid", "messages", "tools",
                 "chat_template_kwargs", "require_reasoning", "log_metrics", "lora_path",
                 "return_prompt_token_ids", "truncate_prompt_tokens"}
# Fields of SGLang's generate request for features radixlm does not have, and what is missing:
# accepted when unset (None, false, 0, empty: clients send them so), else refused with a 400.
UNSUPPORTED_FIELDS = {
    **dict.fromkeys(("image_data", "video_data", "audio_data", "modalities", "mm_hashes", "mm_content_hashes",
                     "use_audio_in_video", "video_config"), "multimodal input (the models served are text-only)"),
    "input_embeds": "input embeddings (send text or input_ids)",
    **dict.fromkeys(("session_id", "session_params"), "sessions (the radix cache shares prefixes without them)"),
    "lora_id": "LoRA adapters by id (name one with lora_path)",
    "custom_logit_processor": "custom logit processors",
    "token_ids_logprob": "logprobs of chosen token ids (use top_logprobs_num)",
    **dict.fromkeys(("return_hidden_states", "return_routed_experts", "routed_experts_start_len",
                     "return_indexer_topk", "positional_embed_overrides"), "hidden-state or expert outputs"),
    **dict.fromkeys(("return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
                     "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64"),
                    "raw logprob formats (logprobs come as [logprob, id, text] entries)"),
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
                     "disagg_prefill_dp_rank"), "prefill/decode disaggregation"),
    **dict.fromkeys(("routed_dp_rank", "data_parallel_rank", "routing_key"),
                    "choosing a data-parallel rank (`radixlm router` routes by prefix)"),
    "background": "background requests",
    "conversation_id": "conversations kept by the server",
    "watermark": "watermarking",
    **dict.fromkeys(("priority", "extra_key", "cache_salt"), "request priorities or cache salts"),
    **dict.fromkeys(("custom_labels", "no_logs", "return_bytes", "return_entropy"), "this request option"),
}


_INT, _NUM, _BOOL, _STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}
_TOKENS = {"type": "array", "items": _INT}
# The JSON a SamplingParams field takes, by the field's annotation: a field of a new type must be
# added here (the schema is built at import, so a missing one fails at once)
_SCHEMA_OF_TYPE = {
    "int": _INT, "int | None": _INT, "float": _NUM, "bool": _BOOL, "str | None": _STR,
    "list[str]": {"anyOf": [_STR, {"type": "array", "items": _STR}]},  # one string is a list of one
    "list[int]": _TOKENS,
    "dict[int, float] | None": {"type": "object", "additionalProperties": _NUM},  # token id -> number
    "dict[str, Any] | None": {"type": "object"},
}
# sampling_params keys that are not SamplingParams fields: tokenizer/choices.py takes these
CHOICE_PARAMS = {"choices": {"type": "array", "items": _STR}, "choices_method": _STR}


def _sampling_params_schema() -> dict[str, Any]:
    """SamplingParams' fields (and SGLang's names for some, ALIASES), each with its field's JSON type."""
    props = {f.name: _SCHEMA_OF_TYPE[str(f.type)] for f in dataclasses.fields(SamplingParams)}
    props |= {alias: props[name] for alias, name in ALIASES.items()}
    return {"type": "object", "properties": props | CHOICE_PARAMS, "additionalProperties": False}


SAMPLING_PARAMS_SCHEMA = _sampling_params_schema()
# The /generate body, for the OpenAPI document (native_requests checks it, with messages that
# name the problem).
GENERATE_BODY_SCHEMA = {
    "type": "object",
    "properties": {
        "text": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        "input_ids": {"anyOf": [_TOKENS, {"type": "array", "items": _TOKENS}]},
        "messages": {"type": "array", "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}},  # OpenAI's shape, shown by the chat template
        "chat_template_kwargs": {"type": "object"},  # with messages: variables for the template (enable_thinking)
        "sampling_params": {"anyOf": [SAMPLING_PARAMS_SCHEMA, {"type": "array", "items": SAMPLING_PARAMS_SCHEMA}]},
        # return_prompt_token_ids: SGLang's, the prompt's ids beside the output's (`prompt_token_ids`)
        **dict.fromkeys(("stream", "return_text_in_logprobs", "require_reasoning", "log_metrics",
                         "return_prompt_token_ids"), _BOOL),
        # vLLM's: only the prompt's last this many tokens (-1: as many as leave room for one new token)
        "truncate_prompt_tokens": _INT,
        # one value for every prompt, or one per prompt (SGLang's batch form)
        "return_logprob": {"anyOf": [_BOOL, {"type": "array", "items": _BOOL}]},
        **dict.fromkeys(("logprob_start_len", "top_logprobs_num"), {"anyOf": [_INT, {"type": "array", "items": _INT}]}),
        "rid": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        # a served LoRA adapter's name (--lora-paths), for every prompt or one per prompt (null: the base model)
        "lora_path": {"anyOf": [_STR, {"type": "array", "items": {"anyOf": [_STR, {"type": "null"}]}}]},
    },
    "additionalProperties": False,
}
assert set(GENERATE_BODY_SCHEMA["properties"]) == NATIVE_FIELDS


def native_requests(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
    """Expand a native /generate body into one GenerateRequest per prompt and sample (n)."""
    refused = [k for k in UNSUPPORTED_FIELDS if body.get(k) not in (None, False, 0, "", [], {})]
    if refused:
        raise BadRequest(f"'{refused[0]}' is not supported: radixlm has no {UNSUPPORTED_FIELDS[refused[0]]}")
    unknown = sorted(set(body) - NATIVE_FIELDS - set(UNSUPPORTED_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(NATIVE_FIELDS)}")
    if not isinstance(body.get("log_metrics", True), bool):
        raise BadRequest("'log_metrics' must be a boolean")
    text, ids, chat = body.get("text"), body.get("input_ids"), body.get("messages")
    if sum(x is not None for x in (text, ids, chat)) != 1:
        raise BadRequest("give exactly one of 'text', 'input_ids' or 'messages'")
    tools = body.get("tools")
    if tools is not None and (chat is None or not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise BadRequest("'tools' goes with 'messages': a list of {\"type\": \"function\", \"function\": {\"name\", ...}}")
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and (chat is None or not isinstance(template_kwargs, dict)):
        raise BadRequest("'chat_template_kwargs' goes with 'messages': an object of template variables")
    prompts, single = _prompts(text, ids, chat)
    params = body.get("sampling_params") or {}
    param_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(param_list) != len(prompts) or not all(isinstance(p, dict) for p in param_list):
        raise BadRequest("'sampling_params' must be an object or a list of objects, one per prompt")
    rids = body.get("rid")
    return_logprob = _per_prompt(body, "return_logprob", False, len(prompts), bool)
    start_len = _per_prompt(body, "logprob_start_len", -1, len(prompts), int)
    top_num = _per_prompt(body, "top_logprobs_num", 0, len(prompts), int)
    lora = _per_prompt(body, "lora_path", None, len(prompts), str)
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
                chat_template_kwargs=template_kwargs,
                require_reasoning=bool(body.get("require_reasoning", False)),
                sampling_params=_sample_params(p, j),
                return_logprob=return_logprob[i],
                logprob_start_len=start_len[i],
                top_logprobs_num=top_num[i],
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                stream=bool(body.get("stream", False)),
                lora_path=lora[i],
                return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
                truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
            ))
    return reqs, single and len(reqs) == 1


def _sample_params(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The sampling params of sample `index` of n: a seed gives each sample its own stream."""
    out = {k: v for k, v in params.items() if k != "n"}
    seed = out.get("seed") if out.get("seed") is not None else out.get("sampling_seed")
    if index and isinstance(seed, int) and not isinstance(seed, bool):
        out.pop("sampling_seed", None)
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


def _per_prompt(body: dict[str, Any], key: str, default: Any, count: int, kind: type) -> list[Any]:
    """`key`'s value for each prompt: one value for all, or SGLang's list of one per prompt."""
    value = body.get(key)
    values = [default if v is None else v for v in value] if isinstance(value, list) else [
        default if value is None else value] * count
    name = {bool: "a boolean", int: "an integer", str: "a string"}[kind]
    if len(values) != count or not all((v is None and default is None) or isinstance(v, kind)
                                       and (kind is bool or not isinstance(v, bool)) for v in values):
        raise BadRequest(f"'{key}' must be {name}, or a list of {count} (one per prompt)")
    return values


def native_result(out: ClientOutput) -> dict[str, Any]:
    """A result in SGLang's shape: `prompt_token_ids` (when asked for) beside the output's, not in meta_info."""
    meta = dict(out.meta_info)
    prompt_ids = meta.pop("prompt_token_ids", None)
    result = {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}
    return result if prompt_ids is None else {**result, "prompt_token_ids": prompt_ids}


class CumulativeStream:
    """SGLang's native stream: each chunk holds the text, the output ids and the output logprob
    lists so far, not what is new (the runtime's outputs carry only what is new)."""

    def __init__(self) -> None:
        self.text, self.ids, self.lists = "", [], {}
        self.prompt_ids: list[int] | None = None

    def chunk(self, out: ClientOutput) -> dict[str, Any]:
        meta = dict(out.meta_info)
        replaced = meta.pop("replaced_tokens", 0)  # jump-forward re-encoded the last ids sent
        if replaced:
            del self.ids[len(self.ids) - replaced:]
        self.ids.extend(out.token_ids)
        self.text += out.text
        self.prompt_ids = meta.pop("prompt_token_ids", self.prompt_ids)  # (the first chunk has them)
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = self.lists.setdefault(key, [])
                meta[key].extend(out.meta_info[key])
        chunk = {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}
        return chunk if self.prompt_ids is None else {**chunk, "prompt_token_ids": self.prompt_ids}


class GenerateAPI(ABC):
    """`generate(...)` of the Python engines, as a native body: both engines take the same
    arguments and return the same shapes as /generate."""

    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        *,
        return_logprob: bool | Sequence[bool] = False,
        logprob_start_len: int | Sequence[int] | None = None,
        top_logprobs_num: int | Sequence[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | Sequence[str] | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """SGLang's `Engine.generate`. One prompt -> a dict; a batch -> a list (n > 1: n per
        prompt, prompt-major). Each result has `text`, `output_ids` and `meta_info` (id,
        prompt/completion/cached tokens, finish_reason and, when asked, logprobs). `stream=True`
        (one prompt, n = 1): an iterator of such results, each holding everything so far.
        `options`: the rest of SGLang's request fields (those for features not here are refused).
        Raises ValueError for refused input."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num,
                                "return_text_in_logprobs": return_text_in_logprobs, "rid": rid, **options}
        if prompt is not None:
            body["text"] = prompt if isinstance(prompt, str) else list(prompt)
        if input_ids is not None:
            batch = bool(input_ids) and not isinstance(input_ids[0], int)
            body["input_ids"] = [list(x) for x in input_ids] if batch else list(input_ids)
        reqs, single = native_requests({k: v for k, v in body.items() if v is not None})
        if stream:
            if not single:
                raise BadRequest("stream=True takes one prompt and n = 1")
            reqs[0].stream = True
            return self._stream_request(reqs[0])
        results = self._run_requests(reqs)
        return results[0] if single else results

    @abstractmethod
    def _run_requests(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        """Run every request to the end; results in order, in native_result's shape."""

    def _stream_request(self, req: GenerateRequest) -> Iterator[dict[str, Any]]:
        raise BadRequest(f"{type(self).__name__} does not stream: use Engine")
