"""`Runtime`: a local runtime (an `Engine`: started in the background, or attached to a running
server's), spoken to over ZeroMQ, no HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixlm.lang.backends.base import Backend, BackendError, Call
from radixlm.runtime.engine import Engine


class Runtime(Backend):
    def __init__(self, model_path: str | None = None, attach: str | None = None, **server_args: Any) -> None:
        """Start the tokenizer and scheduler processes (options are ServerArgs fields), or, with
        `attach="http://host:port"`, use the runtime of a `radixlm serve` running on this machine."""
        if attach is None:
            self.engine = Engine(model_path, **server_args)
            return
        if model_path is not None or server_args:
            raise ValueError("an attached runtime keeps the options it was started with")
        import httpx

        address = httpx.get(attach.rstrip("/") + "/get_server_info", timeout=30).json().get("client_address")
        if not address:
            raise BackendError(f"{attach} does not offer a ZeroMQ address to attach to")
        self.engine = Engine.attach(address)

    def generate(self, call: Call) -> dict[str, Any] | list[dict[str, Any]]:
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

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.server_info()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _arguments(call: Call) -> dict[str, Any]:
    # only the options the program set: Engine.stream takes fewer than generate
    return {"prompt": call.text, "sampling_params": call.sampling_params, **call.options}
