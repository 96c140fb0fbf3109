"""What the server's endpoints share: ``ServerState`` (the RuntimeClient, the runtime's facts,
the metrics, whether every runtime process lives), and running requests through the client:
every request's final output (``gather_outputs``) or their streamed outputs interleaved
(``merge_streams``), and a streamed chat choice in another protocol's events (``stream_choice``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from radixlm.runtime.client import RuntimeClient
from radixlm.runtime.messages import ClientOutput, GenerateRequest
from radixlm.runtime.native import native_result
from radixlm.runtime.server.http_common import HTTPError
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.openai_builders import RequestAborted, aggregate_usage, openai_finish_reason
from radixlm.runtime.server.output_readers import ChoiceStream


class ServerState:
    """What the endpoints share: the client, the runtime's facts, and whether all processes live."""

    def __init__(self, client: RuntimeClient, info: dict[str, Any], server_args: dict[str, Any], model_name: str) -> None:
        self.client = client
        self.info = info
        self.server_args = server_args
        self.model_name = model_name
        self.started = int(time.time())
        self.metrics = Metrics()
        client.on_finish = self.metrics.observe
        self.dead: str | None = None  # set by the watchdog when a runtime process dies

    async def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters served now, name -> folder, as their one owner (the scheduler) says."""
        return (await self.client.control("lora_adapters"))["adapters"]


async def gather_outputs(client: RuntimeClient, reqs: list[GenerateRequest]) -> list[ClientOutput]:
    """Every request's final output. When one fails, the rest are aborted: the caller gets the
    error alone, and nobody would read their outputs (gather alone would leave them running)."""
    tasks = [asyncio.ensure_future(client.generate(r)) for r in reqs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:  # a no-op for the finished ones
            t.cancel()


async def merge_streams(client: RuntimeClient, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, ClientOutput]]:
    """Interleave the outputs of several streaming requests as they arrive, tagged by index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            async for out in client.stream(req):
                await queue.put((i, out))
        except Exception as e:  # a refusal, or a defect: either way the caller's stream ends with it
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        remaining = len(reqs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:  # cancelling aborts requests still running (client went away)
            t.cancel()


async def stream_choice(state: ServerState, reqs: list[GenerateRequest], choice: ChoiceStream,
                        start: Callable[[ClientOutput], bytes], feed: Callable[[list[dict[str, Any]]], bytes],
                        finish: Callable[[ClientOutput, str | None, dict[str, Any]], bytes]) -> AsyncIterator[bytes]:
    """One streamed chat choice in another protocol's events (the Responses and Messages APIs):
    `start` once the runtime has answered (so a request it refuses gets a plain 4xx), then each
    output's chat deltas through `feed`, and `finish` with the chat finish reason and usage."""
    started = False
    async for _, out in merge_streams(state.client, reqs):
        if not started:
            yield start(out)
            started = True
        result = native_result(out)
        try:
            reason = openai_finish_reason(out.meta_info.get("finish_reason")) if out.finished else None
        except RequestAborted as e:
            raise HTTPError(f"the request was aborted: {e}", 500) from None
        yield feed(choice.feed(result["text"], out.finished))
        if out.finished:
            yield finish(out, reason, aggregate_usage([result], 1))
