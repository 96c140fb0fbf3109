"""What the server's endpoints share: ``ServerState`` (the RuntimeClient, the runtime's facts,
the metrics, whether every runtime process lives), and running requests through the client:
every request's final output (``gather_outputs``) or their streamed outputs interleaved
(``merge_streams``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from radixlm.runtime.client import RuntimeClient
from radixlm.runtime.messages import ClientOutput, GenerateRequest
from radixlm.runtime.server.metrics import Metrics


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
