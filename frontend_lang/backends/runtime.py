"""`Runtime`: a local runtime started in the background (an `Engine`), spoken to over ZeroMQ, no HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend_lang.backends.base import Backend, BackendError, Call
from runtime.engine import Engine


class Runtime(Backend):
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        """Start the tokenizer and scheduler processes; options are ServerArgs fields."""
        self.engine = Engine(model_path, **server_args)

    def generate(self, call: Call) -> dict[str, Any]:
        try:
            return self.engine.generate(**_arguments(call))
        except ValueError as e:  # refused by the runtime (RequestFailed, BadRequest, SamplingParamsError)
            raise BackendError(str(e)) from None

    def stream(self, call: Call) -> Iterator[dict[str, Any]]:
        try:
            yield from self.engine.stream(**_arguments(call))
        except ValueError as e:
            raise BackendError(str(e)) from None

    def model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _arguments(call: Call) -> dict[str, Any]:
    return {"prompt": call.text, "sampling_params": call.sampling_params, "return_logprob": call.return_logprob,
            "top_logprobs_num": call.top_logprobs_num}
