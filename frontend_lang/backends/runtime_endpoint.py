"""`RuntimeEndpoint`: a radixlm (or SGLang) server over HTTP, native API."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import Any

import httpx
import orjson

from radixlm.lang.backends.base import Backend, BackendError, Call
from radixlm.lang.chat_template import ChatTemplate, get_chat_template


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: str | bool | None = None,
                 chat_template_name: str | None = None, timeout: float = 600) -> None:
        """SGLang's arguments: `verify` is TLS verification (a CA bundle path, or False);
        `chat_template_name` (chatml, llama-3, plain) overrides the template the model reports."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._template_name = chat_template_name
        if chat_template_name is not None:
            get_chat_template(chat_template_name)  # an unknown name fails here, not at the first role
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                  verify=True if verify is None else verify)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        if self._template_name is not None:
            return get_chat_template(self._template_name)
        return super().chat_template

    def generate(self, call: Call) -> dict[str, Any] | list[dict[str, Any]]:
        """One result; with n > 1, a list of n."""
        r = self._http.post("/generate", json=call.native_body())
        _check(r)
        return r.json()

    @cached_property
    def _cumulative_streams(self) -> bool:
        """Whether the server's stream chunks hold everything so far (SGLang's default) rather
        than only what is new (its `--incremental-streaming-output`)."""
        return not self.get_server_info().get("incremental_streaming_output", False)

    def stream(self, call: Call) -> Iterator[dict[str, Any]]:
        """Chunks with only what is new, whichever way the server streams."""
        cumulative, sent_text, sent_ids = self._cumulative_streams, 0, 0
        with self._http.stream("POST", "/generate", json={**call.native_body(), "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                _check(r)
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        raise BackendError(str(chunk["error"]))
                    if cumulative:
                        text, ids = chunk["text"], chunk["output_ids"]
                        chunk = {**chunk, "text": text[sent_text:], "output_ids": ids[sent_ids:]}
                        sent_text, sent_ids = len(text), len(ids)
                    yield chunk

    def model_info(self) -> dict[str, Any]:
        r = self._http.get("/get_model_info")
        _check(r)
        return r.json()

    def get_server_info(self) -> dict[str, Any]:
        r = self._http.get("/get_server_info")
        if r.status_code == 404:  # an SGLang server of a newer release
            r = self._http.get("/server_info")
        _check(r)
        return r.json()

    def flush_cache(self) -> bool:
        r = self._http.post("/flush_cache")
        if r.status_code == 409:  # requests are running
            return False
        _check(r)
        return True

    def shutdown(self) -> None:
        self._http.close()


def _check(r: httpx.Response) -> None:
    if r.status_code != 200:
        try:
            detail = r.json().get("error", {})
            message = detail.get("message", r.text) if isinstance(detail, dict) else str(detail)
        except ValueError:
            message = r.text
        raise BackendError(f"{r.request.url.path} answered {r.status_code}: {message}")
