"""Retraction: when the running requests' next tokens do not fit in the pool, some step back.

Admission reserves decode room by the new-token ratio, an estimate; when requests outgrow it,
the least advanced step back: the request being chunked first (it has no output yet), then
the running request with the fewest output tokens (the longest prompt among equals, whose
prefill the cache is most likely to keep). A retracted request's KV goes to the prefix cache
and it waits at the front of the queue with its tokens, to be prefilled again. A request
that does not fit with the whole pool to itself ends there, at the pool's limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from radixlm.runtime.scheduler.admission import step_pages
from radixlm.runtime.scheduler.kv_manager import KVManager
from radixlm.runtime.scheduler.req import Req

log = logging.getLogger(__name__)


@dataclass
class Retraction:
    retracted: list[Req] = field(default_factory=list)  # in the order they stepped back
    ended: Req | None = None  # filled the pool alone: it finishes with `length`


def make_room(kv: KVManager, running: list[Req], chunked: Req | None) -> Retraction:
    """Take requests out of `running` (and the chunked one) until this step's tokens of the
    rest fit; their KV is handed to the prefix cache. The caller requeues `retracted`."""
    out = Retraction()
    while running and step_pages(kv, running) > kv.available_pages:
        if chunked is not None:
            victim, chunked = chunked, None
        elif len(running) == 1:
            out.ended = running.pop()
            log.warning("request %s filled the KV cache pool alone; it ends there", out.ended.rid)
            break
        else:
            victim = min(running, key=lambda r: (len(r.output_ids), -r.prompt_len))
            running.remove(victim)
        kv.release(victim)
        out.retracted.append(victim)
    return out
