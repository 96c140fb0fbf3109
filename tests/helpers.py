"""Checks shared by the tests."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence

# Where test processes started as `python -m ...` run: not the repository root, whose kernels/
# would shadow the installed `kernels` package that transformers imports (`-m` puts the working
# folder first on sys.path).
MODULE_CWD = tempfile.gettempdir()


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_drained(engine) -> None:
    """After a workload: the KV accounting identity holds and no request still owns a page."""
    sched = engine.scheduler
    assert not sched.has_work, f"requests left: {sched.num_requests}"
    sched.check_accounting()
    kv = sched.kv
    assert kv.cache.locked_pages == 0, f"{kv.cache.locked_pages} pages still locked"
    assert kv.allocator.num_free_pages + kv.cache.evictable_pages == kv.num_pages


def anthropic_event(data: str):
    """One streamed Messages API event (its JSON data), validated by the `anthropic` SDK's models: a
    ping is the bare {"type": "ping"} the SDK skips (returned as a dict), an error event the SDK's
    error response."""
    from anthropic.types import ErrorResponse, RawMessageStreamEvent
    from pydantic import TypeAdapter

    if '"type":"ping"' in data:
        assert data == '{"type":"ping"}'
        return {"type": "ping"}
    if data.startswith('{"type":"error"'):
        return ErrorResponse.model_validate_json(data)
    return TypeAdapter(RawMessageStreamEvent).validate_json(data)
