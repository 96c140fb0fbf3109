"""What the scheduler's steps did, kept for people watching (the dashboard's charts).

Two bounded rings, each added to in O(1) a step: the latest steps one by one (`StepRecord`), and
per-second totals over the last minutes (`SecondTotals`), so that a fast device's many steps a
second cover minutes too. Times are the scheduler process's `time.monotonic()`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import NamedTuple


class StepRecord(NamedTuple):
    """One step, as the dashboard shows it."""

    at: float  # time.monotonic() when it ended
    decode_rows: int  # running requests with one token (or a jump's forced text) and no drafts
    prefill_rows: int
    prefill_tokens: int
    verify_rows: int  # running requests whose drafts the step checked (speculative decoding)
    sampled: int  # tokens the step produced
    running: int  # requests running after the step
    queued: int  # requests waiting (or compiling their constraint) after it
    prompt_tokens: int  # of the requests admitted since the step before: their tokens to compute,
    cached_tokens: int  # and of those, the ones the prefix cache (or the KV tier) held
    free_pages: int  # KV pages by state after the step
    evictable_pages: int
    locked_pages: int
    request_pages: int
    tier_pages: int  # pages' worth of K/V in the KV tier (--kv-tier-path)


_LEVELS = ("running", "queued", "free_pages", "evictable_pages", "locked_pages", "request_pages", "tier_pages")
_SUMS = ("decode_rows", "prefill_rows", "prefill_tokens", "verify_rows", "sampled", "prompt_tokens", "cached_tokens")


class StepLog:
    def __init__(self, steps: int = 600, seconds: int = 300) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=steps)
        # one dict per second that had a step: "t" (its whole second), "steps", the sums of _SUMS,
        # and the levels (_LEVELS) as its last step left them
        self.seconds: deque[dict] = deque(maxlen=seconds)

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        t = math.floor(record.at)
        if not self.seconds or self.seconds[-1]["t"] != t:
            self.seconds.append({"t": t, "steps": 0, **dict.fromkeys(_SUMS, 0)})
        totals = self.seconds[-1]
        totals["steps"] += 1
        for name in _SUMS:
            totals[name] += getattr(record, name)
        for name in _LEVELS:
            totals[name] = getattr(record, name)

    def activity(self, window_s: float = 2.0) -> dict:
        """The latest step and the tokens per second produced over the last `window_s` seconds."""
        now = time.monotonic()
        recent = [r for r in self.steps if r.at >= now - window_s]
        last = self.steps[-1] if self.steps else None
        return {"tokens_per_s": sum(r.sampled for r in recent) / window_s,
                "steps_per_s": len(recent) / window_s,
                "last_step": None if last is None else {**last._asdict(), "seconds_ago": now - last.at}}

    def history(self, since: float | None = None) -> dict:
        """The records after `since` (a `now` this returned before; None: all kept): the steps that
        ended after it, and the seconds from its own on (that one may have grown since)."""
        steps = list(self.steps) if since is None else [r for r in self.steps if r.at > since]
        first = -math.inf if since is None else math.floor(since)
        return {"now": time.monotonic(), "steps": [r._asdict() for r in steps],
                "seconds": [dict(s) for s in self.seconds if s["t"] >= first]}
