"""The constraint compiler and the per-step bitmask, on a toy vocabulary."""

from __future__ import annotations

import json
import time

import pytest
import torch
from radixlm.runtime.constrained.backend import GrammarError
from radixlm.runtime.constrained.grammar import GrammarCompiler, grammar_bitmask
from radixlm.runtime.constrained.outlines_backend import OutlinesBackend
from radixlm.runtime.token_mask import apply_bitmask

TOKENS = {"a": 1, "b": 2, "ab": 3, "1": 4, "2": 5, "{": 6, "}": 7, '"': 8, ".": 9, "x": 40, "y": 70}
VOCAB = 80  # wider than 64 so rows span three mask words
EOS = 0
TABLE = [None] * VOCAB
for _text, _id in TOKENS.items():
    TABLE[_id] = _text.encode()


def make_compiler(**kw) -> GrammarCompiler:
    return GrammarCompiler(OutlinesBackend(TABLE, EOS), workers=1, **kw)


@pytest.fixture()
def compiler():
    c = make_compiler(cache_size=2)
    yield c
    c.shutdown()


def allowed(matcher) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, grammar_bitmask([matcher], VOCAB))
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _wait(c, key):
    c.submit(key)
    for _ in range(1000):
        result = c.poll(key)
        if result is not None:
            return result
        time.sleep(0.01)
    raise AssertionError("compile did not finish")


def test_mask_allows_exactly_the_guides_tokens(compiler):
    grammar = _wait(compiler, ("regex", "(a|b)+[xy]"))
    matcher = compiler.matcher(grammar)
    mask = grammar_bitmask([None, matcher], VOCAB)
    logits = torch.zeros(2, VOCAB)
    apply_bitmask(logits, mask)
    assert torch.isfinite(logits[0]).all(), "an unconstrained row stays open"
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == set(matcher.guide.get_tokens()) == {1, 2, 3}
    matcher.advance(3)
    assert allowed(matcher) == {1, 2, 3, 40, 70}
    matcher.advance(40)
    assert allowed(matcher) == {EOS}  # complete: only the end


def test_an_optional_part_after_a_possible_end_stays_reachable(compiler):
    """outlines-core alone drops a token whose last byte leaves an accepting position for a
    non-accepting one: after "1", a float could never take "." (see constraint_regex.END_MARK)."""
    grammar = _wait(compiler, ("dtype", "float"))
    matcher = compiler.matcher(grammar)
    matcher.advance(4)  # "1": may end, or go on
    assert allowed(matcher) == {4, 5, 9, EOS}
    matcher.advance(9)  # "1.": must go on
    assert allowed(matcher) == {4, 5}
    matcher.advance(5)  # "1.2"
    assert allowed(matcher) == {4, 5, EOS}
    state = matcher.guide.get_state()
    assert grammar.allows(state, EOS, EOS) and not grammar.allows(state, 9, EOS)


def test_errors_name_the_problem_and_results_are_cached(compiler):
    assert isinstance(_wait(compiler, ("regex", "(unclosed")), GrammarError)
    err = _wait(compiler, ("json_schema", "{nope"))
    assert isinstance(err, GrammarError) and "not valid JSON" in str(err)
    first = _wait(compiler, ("regex", "a+"))
    assert compiler.poll(("regex", "a+")) is first  # cached
    _wait(compiler, ("regex", "b+"))
    _wait(compiler, ("regex", "ab"))  # cache_size 2: "a+" is evicted
    compiler.submit(("regex", "a+"))
    assert _wait(compiler, ("regex", "a+")) is not first


def test_an_exploding_regex_times_out_and_the_compiler_recovers():
    c = make_compiler(timeout_s=1.0)
    try:
        started = time.monotonic()
        err = _wait(c, ("regex", "(a|b)*a(a|b){40}"))  # 2^40 automaton states
        assert isinstance(err, GrammarError) and "more than 1s" in str(err)
        assert time.monotonic() - started < 4
        (stuck,) = c._children
        assert stuck.returncode is not None  # killed, not left burning a core
        assert not isinstance(_wait(c, ("regex", "ab")), GrammarError)  # a fresh child takes over
        (fresh,) = c._children  # the killed one is forgotten
        assert fresh is not stuck and fresh.poll() is None
    finally:
        c.shutdown()
    assert all(child.poll() is not None for child in c._children)


def test_deeply_nested_schemas_are_refused_with_a_reason(compiler):
    err = _wait(compiler, ("json_schema", '{"items": ' * 200 + "{}" + "}" * 200))
    assert isinstance(err, GrammarError) and "more than 128 deep" in str(err)
    err = _wait(compiler, ("json_schema", '{"items": ' * 5000 + "{}" + "}" * 5000))  # past json's recursion limit
    assert isinstance(err, GrammarError) and "json_schema" in str(err)


def test_a_schema_whose_regex_explodes_is_stopped():
    schema = {"type": "integer"}
    for _ in range(40):  # shallow enough to pass the nesting check; its regex would take 4^40 bytes
        schema = {"type": "array", "items": schema}
    c = make_compiler(timeout_s=5.0)
    try:
        err = _wait(c, ("json_schema", json.dumps(schema)))
        assert isinstance(err, GrammarError), err
        assert not isinstance(_wait(c, ("regex", "ab")), GrammarError)
    finally:
        c.shutdown()


def test_date_time_and_time_formats_require_an_offset():
    """JSON Schema's date-time and time are RFC 3339: the offset is not optional."""
    import json
    import re

    from radixlm.runtime.constrained.constraint_regex import to_regex

    rx = to_regex(("json_schema", json.dumps({"type": "string", "format": "date-time"})))
    assert re.fullmatch(rx, '"2008-07-18T00:00:00Z"') and re.fullmatch(rx, '"2008-07-18T23:59:01.5+02:00"')
    assert not re.fullmatch(rx, '"2008-07-18T00:00:00"')
    rx = to_regex(("json_schema", json.dumps({"type": "string", "format": "time"})))
    assert re.fullmatch(rx, '"10:20:30-05:00"') and not re.fullmatch(rx, '"10:20:30"')


def test_a_failure_is_answered_to_every_waiter_and_kept_for_a_while():
    """Before: the first poll took a failed compile away and the next waiter's poll raised KeyError."""
    c = make_compiler(failure_ttl_s=0.5)
    try:
        key = ("regex", "(unclosed")
        c.submit(key)
        c.submit(key)  # a second request on the same key: one compile
        first = _wait(c, key)
        assert isinstance(first, GrammarError) and c.poll(key) is first  # every waiter gets the same answer
        c.submit(key)
        assert c.poll(key) is first and c.num_compiling == 0  # kept: no compile for the next request
        time.sleep(0.6)
        c.submit(key)  # past failure_ttl_s a failure is tried again (the limit may have been load)
        assert c.num_compiling == 1 or c.poll(key) is not first
        assert isinstance(_wait(c, key), GrammarError)
    finally:
        c.shutdown()


def test_a_compile_no_one_waits_for_is_dropped_and_compiles_wake_the_ready_fd():
    import select

    c = make_compiler(timeout_s=1.0)  # one worker
    try:
        assert select.select([c.ready_fd], [], [], 0)[0] == []
        c.submit(("regex", "(a|b)*a(a|b){40}"))  # occupies the only worker until its time limit
        c.submit(("regex", "ab"))
        assert c.num_compiling == 2
        c.forget(("regex", "ab"))  # its only waiter left before it started: it never runs
        assert c.num_compiling == 1
        assert select.select([c.ready_fd], [], [], 3.0)[0] == [c.ready_fd]  # the time-out ended a compile
        c.drain_ready()
        assert select.select([c.ready_fd], [], [], 0)[0] == []
        assert c.num_compiling == 0 and c.poll(("regex", "ab")) is None  # asked again: compiled afresh
        assert not isinstance(_wait(c, ("regex", "ab")), GrammarError)
    finally:
        c.shutdown()
