"""`Runtime`: a local runtime started in the background (an `Engine`), spoken to over ZeroMQ, no HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend_lang.backends.base import Backend, BackendError
from runtime.engine import Engine


class Runtime(Backend):
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        """Start the tokenizer and scheduler processes; options are ServerArgs fields."""
        self.engine = Engine(model_path, **server_args)

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.engine.generate(**_arguments(body))
        except ValueError as e:  # refused by the runtime (RequestFailed, BadRequest, SamplingParamsError)
            raise BackendError(str(e)) from None

    def stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            yield from self.engine.stream(**_arguments(body))
        except ValueError as e:
            raise BackendError(str(e)) from None

    def model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _arguments(body: dict[str, Any]) -> dict[str, Any]:
    """A native body of the interpreter's (one text prompt) as Engine keyword arguments."""
    return {"prompt": body["text"], "sampling_params": body.get("sampling_params"),
            "return_logprob": body.get("return_logprob", False), "top_logprobs_num": body.get("top_logprobs_num", 0)}
