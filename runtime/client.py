"""The one client of the runtime: what the HTTP server, the Engine and the DSL use.

`RuntimeClient` is asyncio-based (one DEALER socket to the tokenizer process; a
reader task routes outputs to the request that asked). `SyncRuntimeClient` runs
one on a private event-loop thread, for blocking callers in any thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Callable, Coroutine, Iterator

import zmq
import zmq.asyncio

from radixlm.runtime import ipc
from radixlm.runtime.messages import AbortRequest, ClientOutput, ControlOutput, ControlRequest, GenerateRequest


class RequestFailed(ValueError):
    """The runtime refused a request; `status` is the HTTP-like code (400: the request's fault)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RuntimeClient:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = ipc.socket(self.ctx, zmq.DEALER, address, bind=False)
        self._waiters: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.on_finish: Callable[[ClientOutput], None] | None = None  # e.g. metrics
        self.max_in_flight: int | None = None  # refuse requests past this many (running + queued)
        self.in_flight = 0

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        while True:
            msg = ipc.decode(await self.sock.recv())
            queue = self._waiters.get(msg.rid)
            if queue is not None:
                queue.put_nowait(msg)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[ClientOutput]:
        """Outputs of one request as they come; the last has finished=True. Raises
        RequestFailed if the runtime refuses it (503 when `max_in_flight` requests are already
        in flight). Leaving early aborts the request."""
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise RequestFailed(f"the server is at its limit of {self.max_in_flight} requests in flight "
                                "(running and queued); retry later", 503)
        self._ensure_reader()
        queue: asyncio.Queue = asyncio.Queue()
        self._waiters[req.rid] = queue
        self.in_flight += 1
        finished = False
        try:
            await self.sock.send(ipc.encode(req))
            while not finished:
                out: ClientOutput = await queue.get()
                if (out.finished or out.error is not None) and self.on_finish is not None:
                    self.on_finish(out)
                if out.error is not None:
                    finished = True
                    raise RequestFailed(out.error, out.status)
                finished = out.finished
                yield out
        finally:
            self.in_flight -= 1
            self._waiters.pop(req.rid, None)
            if not finished:  # the caller went away (e.g. the HTTP client disconnected)
                await self.abort(req.rid)

    async def generate(self, req: GenerateRequest) -> ClientOutput:
        """The finished result of one non-streaming request."""
        req.stream = False
        last = None
        async for out in self.stream(req):
            last = out
        return last

    async def abort(self, rid: str) -> None:
        await self.sock.send(ipc.encode(AbortRequest(rid)))

    async def control(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        self._ensure_reader()
        rid = f"control-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self._waiters[rid] = queue
        try:
            await self.sock.send(ipc.encode(ControlRequest(rid, op, args)))
            out: ControlOutput = await queue.get()
            return out.data
        finally:
            self._waiters.pop(rid, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)
        self.ctx.term()


class SyncRuntimeClient:
    """Blocking calls on a RuntimeClient that lives on its own event-loop thread."""

    def __init__(self, address: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixlm-client", daemon=True)
        self._thread.start()
        self._client = self._call(self._make(address))

    @staticmethod
    async def _make(address: str) -> RuntimeClient:
        return RuntimeClient(address)

    def _call(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, req: GenerateRequest) -> ClientOutput:
        return self._call(self._client.generate(req))

    def generate_many(self, reqs: list[GenerateRequest]) -> list[ClientOutput | RequestFailed]:
        """All at once (so the scheduler batches them); an error in one does not stop the others."""

        async def run() -> list:
            return await asyncio.gather(*(self._client.generate(r) for r in reqs), return_exceptions=True)

        return self._call(run())

    def stream(self, req: GenerateRequest) -> Iterator[ClientOutput]:
        """The outputs of one streaming request as they arrive; closing the iterator early aborts it."""
        req.stream = True
        outputs: queue.Queue = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for out in self._client.stream(req):
                    outputs.put(out)
            except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
                outputs.put(e)
            finally:
                outputs.put(done)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := outputs.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()  # a no-op once finished; else the stream's cleanup aborts the request

    def abort(self, rid: str) -> None:
        self._call(self._client.abort(rid))

    def control(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._call(self._client.control(op, args))

    def close(self) -> None:
        async def shut() -> None:
            self._client.close()

        self._call(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
