"""The dashboard's step log: the latest steps, and per-second totals that a later poll reads
from where it left off."""

from __future__ import annotations

import torch

from radixlm.runtime.cache.kv_pool import ReqToTokenTable
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.kv_manager import KVManager
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.scheduler.step_log import StepLog, StepRecord


def _step(at: float, sampled: int, running: int, prompt: int = 0, cached: int = 0) -> StepRecord:
    return StepRecord(at, running, 0, 0, 0, sampled, running, 1, prompt, cached, 10, 5, 2, 3, 0)


def test_seconds_sum_their_steps_and_keep_the_last_levels() -> None:
    log = StepLog(steps=3, seconds=2)
    for at, sampled, running in ((10.2, 1, 1), (10.7, 2, 2), (11.1, 4, 3), (12.5, 8, 1)):
        log.add(_step(at, sampled, running, prompt=10, cached=4))
    assert [r.at for r in log.steps] == [10.7, 11.1, 12.5]  # bounded
    seconds = log.history()["seconds"]
    assert [s["t"] for s in seconds] == [11, 12]  # bounded: second 10 is gone
    assert [(s["steps"], s["sampled"], s["running"], s["prompt_tokens"], s["cached_tokens"]) for s in seconds] == \
        [(1, 4, 3, 10, 4), (1, 8, 1, 10, 4)]


def test_history_since_an_earlier_answer_is_what_came_after() -> None:
    log = StepLog()
    log.add(_step(5.1, 1, 1))
    log.add(_step(5.6, 1, 1))
    since = 5.6
    log.add(_step(5.9, 2, 1))
    log.add(_step(6.2, 3, 1))
    view = log.history(since)
    assert [s["at"] for s in view["steps"]] == [5.9, 6.2]
    # the second `since` fell in is sent again, whole: it grew after that answer
    assert [(s["t"], s["steps"], s["sampled"]) for s in view["seconds"]] == [(5, 3, 4), (6, 1, 3)]
    assert log.activity(window_s=1e9)["last_step"]["sampled"] == 3


def test_an_admission_backed_out_counts_no_hit_and_no_prompt() -> None:
    """Admission tries a request and may back out (it did not fit): only what was admitted counts."""
    kv = KVManager(16, 4, ReqToTokenTable(4, 64, "cpu"), True, torch.device("cpu"))

    def admitted(tokens: list[int]) -> Req:
        req = Req(TokenizedRequest(rid="r", input_ids=tokens, sampling_params=SamplingParams(max_new_tokens=1)), 0)
        kv.admit(req)
        return req

    first = admitted(list(range(12)))
    kv.extend_slots(first, first.seq_len)
    first.cached_len = first.seq_len
    kv.release(first)
    assert kv.take_admitted() == (12, 0)
    tried = admitted(list(range(8)) + [99, 98])  # 8 tokens cached
    assert tried.prefix_len == 8
    kv.undo_admit(tried)
    assert kv.take_admitted() == (0, 0)
    assert kv.cache.snapshot()["children"][0]["hits"] == 0
    kept = admitted(list(range(8)) + [99, 98])
    assert kv.take_admitted() == (10, 8) and kv.cache.snapshot()["children"][0]["hits"] == 1
    kv.undo_admit(kept)
    kv.check_accounting([])
