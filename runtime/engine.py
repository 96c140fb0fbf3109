"""The Python API over a background process group: `Engine(...).generate(...)`.

`Engine` starts the tokenizer and scheduler processes (as `radixlm serve`
does, without HTTP) and talks to them through the runtime's client, so it
batches concurrent calls from many threads like a server. For everything in
one process (tests, benchmarks), see `runtime.local_engine.LocalEngine`.
"""

from __future__ import annotations

import atexit
from typing import Any, Sequence

from runtime.args import ServerArgs
from runtime.client import RequestFailed, SyncRuntimeClient
from runtime.launch import launch_processes
from runtime.native import native_requests, native_result


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        """Options are ServerArgs fields (page_size, max_total_tokens, ...)."""
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self._group = launch_processes(self.args)
        self._client = SyncRuntimeClient(self._group.client_address)
        self.info = self._group.info
        atexit.register(self.shutdown)

    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One prompt -> a dict; a batch -> a list (n > 1: n per prompt). Same shapes as /generate.

        Raises ValueError (`BadRequest` or `RequestFailed`) for input the runtime refuses."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        if prompt is not None:
            body["text"] = list(prompt) if not isinstance(prompt, str) else prompt
        if input_ids is not None:
            body["input_ids"] = [list(x) for x in input_ids] if input_ids and not isinstance(input_ids[0], int) else list(input_ids)
        return self._run(body)

    def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Generate the assistant's reply to a conversation, rendered with the model's chat template."""
        return self._run({"messages": messages, "sampling_params": sampling_params or {}})

    def _run(self, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        reqs, single = native_requests(body)
        outs = self._client.generate_many(reqs)
        failed = next((o for o in outs if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        results = [native_result(o) for o in outs]
        return results[0] if single else results

    def flush_cache(self) -> bool:
        return self._client.control("flush_cache")["success"]

    def server_info(self) -> dict[str, Any]:
        return self._client.control("server_info")

    def check_accounting(self) -> dict[str, Any]:
        return self._client.control("check_accounting")

    def shutdown(self) -> None:
        """Stop the processes (idempotent; also runs at interpreter exit)."""
        if self._group is None:
            return
        try:
            self._client.close()
        finally:
            self._group.shutdown()
            self._group = None
            atexit.unregister(self.shutdown)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["Engine", "RequestFailed"]
