"""`RuntimeEndpoint`: a radixlm (or SGLang) server over HTTP, native API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from radixlm.lang.backends.base import Backend, BackendError, Call


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def generate(self, call: Call) -> dict[str, Any]:
        r = self._http.post("/generate", json=call.native_body())
        _check(r)
        return r.json()

    def stream(self, call: Call) -> Iterator[dict[str, Any]]:
        with self._http.stream("POST", "/generate", json={**call.native_body(), "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                _check(r)
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        raise BackendError(str(chunk["error"]))
                    yield chunk

    def model_info(self) -> dict[str, Any]:
        r = self._http.get("/get_model_info")
        _check(r)
        return r.json()

    def flush_cache(self) -> None:
        self._http.post("/flush_cache")

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
