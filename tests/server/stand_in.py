"""A stand-in for the runtime behind the app: it answers every request with the same text, cut
into given pieces, so the HTTP layer's reading of a model's output (tool calls, reasoning, finish
reasons, protocols' events) is tested on the app alone, with no model and no server process."""

from __future__ import annotations

from typing import Any, Iterator

from fastapi.testclient import TestClient

from radixlm.runtime.messages import ClientOutput
from radixlm.runtime.server.http_server import ServerState, create_app

EOS = 2


class StandInClient:
    """Streams `pieces` (the last one finished with `finish`, a native finish reason: EOS by
    default), then raises `then` if given; a request that is not streamed gets them whole."""

    on_finish = None

    def __init__(self, pieces: list[str], finish: dict[str, Any] | None = None,
                 then: Exception | None = None) -> None:
        self.pieces, self.then = pieces, then
        self.finish = finish or {"type": "stop", "matched": EOS}

    def _outputs(self, rid: str) -> Iterator[ClientOutput]:
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1 and self.then is None
            meta = {"prompt_tokens": 3, "completion_tokens": i + 1, "cached_tokens": 0}
            if last:
                meta["finish_reason"] = self.finish
            yield ClientOutput(rid, text, [i + 10], meta, finished=last)

    async def stream(self, req):
        for out in self._outputs(req.rid):
            yield out
        if self.then is not None:
            raise self.then

    async def generate(self, req) -> ClientOutput:
        outs = list(self._outputs(req.rid))
        if self.then is not None:
            raise self.then
        return ClientOutput(req.rid, "".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
                            outs[-1].meta_info, finished=True)


def app(client: StandInClient, **server_args) -> TestClient:
    return TestClient(create_app(ServerState(client, {}, server_args, "smol")))
