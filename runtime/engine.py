"""The Python API over a background process group: `Engine(...).generate(...)`.

`Engine` starts the tokenizer and scheduler processes (as `radixlm serve`
does, without HTTP) and talks to them through the runtime's client, so it
batches concurrent calls from many threads like a server. For everything in
one process (tests, benchmarks), see `radixlm.runtime.local_engine.LocalEngine`.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from typing import Any

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.client import RequestFailed, SyncRuntimeClient
from radixlm.runtime.launch import launch_processes
from radixlm.runtime.messages import GenerateRequest
from radixlm.runtime.native import CumulativeStream, GenerateAPI, native_requests, native_result


class Engine(GenerateAPI):
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        """Options are ServerArgs fields (page_size, max_total_tokens, ...)."""
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self._group = launch_processes(self.args)
        self._client: SyncRuntimeClient | None = SyncRuntimeClient(self._group.client_address)
        self.info = self._group.info
        atexit.register(self.shutdown)

    @classmethod
    def attach(cls, client_address: str) -> Engine:
        """An Engine over a runtime that is already running, e.g. a `radixlm serve` on this machine
        (its `/get_server_info` has the `client_address`); `shutdown` only disconnects."""
        engine = cls.__new__(cls)
        engine.args, engine._group, engine.info = None, None, {}
        engine._client = SyncRuntimeClient(client_address)
        atexit.register(engine.shutdown)
        return engine

    def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Generate the assistant's reply to a conversation, rendered with the model's chat template."""
        reqs, _ = native_requests({"messages": messages, "sampling_params": sampling_params or {}})
        return self._run_requests(reqs)[0]

    def stream(self, prompt: str, sampling_params: dict[str, Any] | None = None, return_logprob: bool = False,
               top_logprobs_num: int = 0, logprob_start_len: int = -1,
               return_text_in_logprobs: bool = False) -> Iterator[dict[str, Any]]:
        """One prompt's result as it is generated: chunks shaped like `generate`'s result, with the
        new `text` and `output_ids`; the last has the finish reason. Leaving early aborts it."""
        reqs, _ = native_requests({"text": prompt, "sampling_params": sampling_params or {}, "stream": True,
                                   "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                                   "logprob_start_len": logprob_start_len,
                                   "return_text_in_logprobs": return_text_in_logprobs})
        if len(reqs) != 1:
            raise ValueError("stream takes one prompt and n = 1")
        for out in self._client.stream(reqs[0]):
            yield native_result(out)

    def _stream_request(self, req: GenerateRequest) -> Iterator[dict[str, Any]]:
        chunks = CumulativeStream()
        for out in self._client.stream(req):
            yield chunks.chunk(out)

    def model_info(self) -> dict[str, Any]:
        return self._client.control("model_info")

    def _run_requests(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        outs = self._client.generate_many(reqs)
        failed = next((o for o in outs if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        return [native_result(o) for o in outs]

    def flush_cache(self) -> bool:
        return self._client.control("flush_cache")["success"]

    def update_weights_from_disk(self, model_path: str, abort_all_requests: bool = False) -> tuple[bool, str]:
        """SGLang's: serve the checkpoint at `model_path` (the same model) from now on, once the
        running requests are done (or aborted); the prefix cache is flushed. (success, message)."""
        out = self._client.control("update_weights", {"model_path": model_path, "abort_all_requests": abort_all_requests})
        return out["success"], out["message"]

    def server_info(self) -> dict[str, Any]:
        return self._client.control("server_info")

    def check_accounting(self) -> dict[str, Any]:
        return self._client.control("check_accounting")

    def shutdown(self) -> None:
        """Stop the processes this Engine started (idempotent; also runs at interpreter exit)."""
        if self._client is None:
            return
        try:
            self._client.close()
        finally:
            self._client = None
            if self._group is not None:
                self._group.shutdown()
                self._group = None
            atexit.unregister(self.shutdown)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["Engine", "RequestFailed"]
