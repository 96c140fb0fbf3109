"""Constrained decoding (regex, JSON schema) on SmolLM2: every output satisfies its constraint,
with jump-forward on and off, and every jump appends only text the constraint forces."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import pytest
import torch

from helpers import assert_drained, common_prefix
from radixlm.runtime.sampling_params import SamplingParamsError

REGEXES = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "yes-no": r"(yes|no|maybe)",
    "word-list": r"[a-z]+(, [a-z]+){2}",
}

S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}}, "required": ["ok", "score"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    {"type": "object", "properties": {"city": S, "tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["city", "tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {
        "type": "string", "maxLength": 24}}, "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"title": S, "subtitle": S}, "required": ["title"]},  # optional field
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["note"]},
    {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}, "required": ["kind", "lives"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}, "required": ["value"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                "required": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}}, "required": ["word"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                                             "maxItems": 2}, "maxItems": 2}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"status": {"enum": ["on", "off"]}, "level": {"enum": [1, 2, 3]}},
     "required": ["status", "level"]},
    {"type": "object", "properties": {"price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]},
                                      "in_stock": {"type": "boolean"}}, "required": ["price", "currency", "in_stock"]},
]


def _chat(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def no_jump(smol):
    return smol.engine_with(disable_jump_forward=True)


@pytest.fixture(params=["jump-forward", "no-jump-forward"])
def engine(request, smol):
    """The SmolLM2 engine with jump-forward (the default) and one without."""
    return smol.engine if request.param == "jump-forward" else request.getfixturevalue("no_jump")


def _assert_jumped_iff_enabled(engine, before: int) -> None:
    jumped = engine.scheduler.jumped_tokens - before
    assert (jumped > 0) == engine.scheduler.jump_forward, jumped


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_full_match_in_a_mixed_batch(engine, temperature, monkeypatch):
    jumped = engine.scheduler.jumped_tokens
    jumps = _record_jumps(engine, monkeypatch)
    prompts = [_chat(engine, f"Give an example of a {name}.") for name in REGEXES]
    params = [{"max_new_tokens": 40, "temperature": temperature, "seed": 3, "regex": rx} for rx in REGEXES.values()]
    free_prompt = _chat(engine, "Say hello.")
    alone = engine.generate(free_prompt, {"max_new_tokens": 12, "temperature": 0})
    results = engine.generate(prompts + [free_prompt], params + [{"max_new_tokens": 12, "temperature": 0}])
    for (name, rx), res in zip(REGEXES.items(), results):
        assert re.fullmatch(rx, res["text"]), f"{name}: {res['text']!r}"
        # sampling may still be inside an open-ended part (e.g. a long word) when max_new_tokens runs out
        assert res["meta_info"]["finish_reason"]["type"] == "stop" or temperature > 0
        _assert_follows_the_constraint(engine, res["output_ids"], {"regex": rx}, jumps[res["meta_info"]["id"]])
    assert results[-1]["output_ids"] == alone["output_ids"], "an unconstrained neighbour must be untouched"
    _assert_jumped_iff_enabled(engine, jumped)
    assert_drained(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, temperature, monkeypatch):
    jumped = engine.scheduler.jumped_tokens
    jumps = _record_jumps(engine, monkeypatch)
    prompts = [_chat(engine, "Answer in JSON: describe something.") for _ in SCHEMAS]
    params = [{"max_new_tokens": 160, "temperature": temperature, "seed": 5, "json_schema": json.dumps(s)}
              for s in SCHEMAS]
    free = _chat(engine, "Tell me a fact.")
    results = engine.generate(prompts + [free], params + [{"max_new_tokens": 10, "temperature": 0}])
    truncated = []
    for i, (schema, res) in enumerate(zip(SCHEMAS, results)):
        constraint = {"json_schema": json.dumps(schema)}
        if res["meta_info"]["finish_reason"]["type"] == "length":
            # greedy, a small model may run an open-ended number ("id": 1234567...) to the limit;
            # every token must still be one the schema allowed
            truncated.append(res["text"])
        else:
            assert res["meta_info"]["finish_reason"]["type"] == "stop", (i, res["text"])
            jsonschema.validate(json.loads(res["text"]), schema, format_checker=jsonschema.FormatChecker())
        _assert_follows_the_constraint(engine, res["output_ids"], constraint, jumps[res["meta_info"]["id"]])
    assert len(truncated) <= 2, truncated
    assert results[-1]["output_ids"] == engine.generate(free, {"max_new_tokens": 10, "temperature": 0})["output_ids"]
    _assert_jumped_iff_enabled(engine, jumped)
    assert_drained(engine)


def _record_jumps(engine, monkeypatch) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Every jump-forward the engine makes, by request id: the output just before it and just after."""
    jumps: dict[str, list[tuple[list[int], list[int]]]] = defaultdict(list)
    jump_forward = engine.scheduler._jump_forward

    def recording(req, *args):
        before = list(req.output_ids)
        changed = jump_forward(req, *args)
        if req.output_ids != before:
            jumps[req.rid].append((before, list(req.output_ids)))
        return changed

    monkeypatch.setattr(engine.scheduler, "_jump_forward", recording)
    return jumps


def _assert_follows_the_constraint(engine, output_ids, constraint, jumps=()) -> None:
    """Every output token, jumped ones included, is one the constraint allowed where it stands; and
    each of the request's `jumps` appended only what the constraint forced: from where the output
    stood, a fresh matcher admits no text that does not begin with the appended bytes, and after an
    appended EOS nothing but EOS."""
    from radixlm.runtime.constrained.backend import constraint_key
    from radixlm.runtime.sampling_params import SamplingParams

    compiler = engine.scheduler.grammar
    grammar = compiler.poll(constraint_key(SamplingParams.from_dict(constraint)))
    eos = engine.scheduler.eos_ids[0]
    *body, last = output_ids
    matcher = _matcher_after(compiler, grammar, body)
    assert matcher is not None and last in _allowed(engine, matcher), engine.tokenizer.convert_ids_to_tokens(
        output_ids)
    token_bytes = compiler.jump_forward.token_bytes
    text = b"".join(token_bytes[t] for t in output_ids if t != eos)
    for before, after in jumps:
        ends = after[-1] == eos  # an EOS appended (`before` never ends in one: an ended output never jumps)
        grown = after[:-1] if ends else after
        old, new = (b"".join(token_bytes[t] for t in ids) for ids in (before, grown))
        assert new.startswith(old) and text.startswith(new), (before, after)  # text is only ever appended
        assert len(new) > len(old) or ends, (before, after)
        assert _matcher_after(compiler, grammar, grown) is not None, engine.tokenizer.convert_ids_to_tokens(grown)
        if len(new) > len(old):
            _assert_only_continuation(engine, grammar, before, new[len(old):])
        if ends:
            _assert_only_continuation(engine, grammar, grown, b"", ends=True)


def _matcher_after(compiler, grammar, tokens):
    """A fresh matcher advanced through `tokens`, or None when it refuses one."""
    matcher = compiler.matcher(grammar)
    if not matcher.accepts(tokens):
        return None
    for t in tokens:
        matcher.advance(t)
    return matcher


def _allowed(engine, matcher) -> set[int]:
    from radixlm.runtime.constrained.grammar import grammar_bitmask

    vocab = engine.scheduler.worker.config.vocab_size
    mask = grammar_bitmask([matcher], vocab)
    return set((((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab])
               .nonzero().flatten().tolist())


def _assert_only_continuation(engine, grammar, start: list[int], forced: bytes, ends: bool = False) -> None:
    """After the tokens `start`, every text the constraint admits begins with `forced` (`ends`: and
    then stops): at every point a token can reach within it, the text cannot end and every allowed
    token's bytes agree with what is left of it."""
    compiler = engine.scheduler.grammar
    token_bytes, eos = compiler.jump_forward.token_bytes, engine.scheduler.eos_ids[0]
    base = _matcher_after(compiler, grammar, start)

    def allowed_after(path: list[int]) -> set[int]:
        nonlocal base
        for t in path:
            base.advance(t)
        allowed = _allowed(engine, base)
        if base.max_rollback >= len(path):
            base.rollback(len(path))
        else:  # (outlines' guide keeps only a few states)
            base = _matcher_after(compiler, grammar, start)
        return allowed

    reached, todo = {0: []}, [0]
    while todo:
        at = todo.pop()
        rest = forced[at:]
        allowed = allowed_after(reached[at])
        moves = allowed - {eos}
        if ends:
            assert not moves and eos in allowed, f"only EOS was to follow, not {sorted(moves)[:8]}"
            continue
        assert eos not in allowed, f"the text may end {at} bytes into the forced {forced!r}"
        assert moves, f"nothing may follow {forced[:at]!r}"
        for t in moves:
            b = token_bytes[t]
            assert b.startswith(rest) or rest.startswith(b), f"{b!r} may follow where {rest!r} was forced"
            if len(b) < len(rest) and at + len(b) not in reached:
                reached[at + len(b)] = reached[at] + [t]
                todo.append(at + len(b))


def test_dtype_outputs_parse(smol):
    engine = smol.engine
    cases = {"int": int, "float": float, "bool": lambda t: {"True": True, "False": False}[t], "str": json.loads}
    questions = {"int": "How many legs does a spider have?", "float": "What is pi to two decimals?",
                 "bool": "Is the sky blue?", "str": "Name one fruit, in one word."}
    prompts = [_chat(engine, questions[name]) for name in cases]
    results = engine.generate(prompts, [{"max_new_tokens": 48, "temperature": 0, "dtype": d} for d in cases])
    for (name, parse), res in zip(cases.items(), results):
        # digits are open-ended (a model may run out of tokens mid-number); the literal still parses
        assert res["meta_info"]["finish_reason"]["type"] == "stop" or name in ("int", "float"), (name, res["text"])
        parse(res["text"])
    with pytest.raises(SamplingParamsError, match="dtype"):
        engine.generate("x", {"dtype": "complex"})


def test_a_float_may_take_its_decimals(smol):
    """After "3" a float may end or go on with "." (outlines-core alone never allowed the "."):
    the model's own answer to this question, with the constraint, keeps its decimals."""
    engine = smol.engine
    res = engine.generate(_chat(engine, "What is pi to two decimals?"),
                          {"max_new_tokens": 8, "temperature": 0, "dtype": "float"})
    assert re.fullmatch(r"[0-9]+\.[0-9]+", res["text"]), res["text"]


def test_a_structural_tag_holds_calls_to_their_schema_and_leaves_text_free(smol, monkeypatch):
    from radixlm.runtime import tool_calls

    engine = smol.engine
    jumps = _record_jumps(engine, monkeypatch)
    add = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}
    call = '<tool_call>\n{{"name": "add", "arguments": {{"x": {}, "y": {}}}}}\n</tool_call>'
    shots = f"Q: add 2 and 3\nA: {call.format(2, 3)}\nQ: add 7 and 1\nA: {call.format(7, 1)}\nQ: add 40 and 2\nA:"
    free = engine.generate(shots, {"max_new_tokens": 40, "temperature": 0})["text"]
    assert '"x": 40' in free  # the examples' wrong keys, copied
    params = {"max_new_tokens": 40, "temperature": 0, "structural_tag": tool_calls.strict_tag([add])}
    res = engine.generate(shots, params)
    content, calls = tool_calls.parse_auto(res["text"], {"add"})
    assert calls, res["text"]
    jsonschema.validate(json.loads(calls[0].arguments), add["function"]["parameters"])
    assert "Q:" in content  # after the call, text is free again
    _assert_follows_the_constraint(engine, res["output_ids"], {"structural_tag": params["structural_tag"]},
                                   jumps[res["meta_info"]["id"]])
    assert jumps[res["meta_info"]["id"]], "the call's keys were meant to be jumped"
    assert_drained(engine)


def test_bad_constraints_fail_alone(smol):
    engine = smol.engine
    results = engine.generate(["a", "b", "c"], [
        {"max_new_tokens": 4, "regex": "(unclosed"},
        {"max_new_tokens": 4, "json_schema": "{not json"},
        {"max_new_tokens": 4, "temperature": 0},
    ])
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "regex" in results[0]["meta_info"]["finish_reason"]["message"]
    assert "json_schema" in results[1]["meta_info"]["finish_reason"]["message"]
    assert results[2]["meta_info"]["completion_tokens"] == 4
    assert_drained(engine)


SCHEMA = {"type": "object", "properties": {"name": S, "age": {"type": "integer"}, "city": S,
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "city", "member"]}


def test_jump_forward_saves_passes_and_leaves_consistent_kv(smol, no_jump, monkeypatch):
    """Jumped text costs no forward pass per token and is text the constraint forced, which
    token-by-token decoding writes too; its KV (re-encoded at the boundary, rolled back and
    recomputed) is what a fresh prefill of the same tokens computes: a follow-up turn that reuses
    it from the prefix cache decodes exactly as on a cacheless engine."""
    prompts = [_chat(smol.engine, f"Describe person number {i} as JSON.") for i in range(6)]
    constraint = {"json_schema": json.dumps(SCHEMA)}
    params = {"max_new_tokens": 96, "temperature": 0, **constraint}
    jumps = _record_jumps(smol.engine, monkeypatch)
    passes, results = {}, {}
    for eng in (smol.engine, no_jump):
        before = eng.scheduler.request_passes
        results[eng] = eng.generate(prompts, params)
        passes[eng.scheduler.jump_forward] = eng.scheduler.request_passes - before
        for res in results[eng]:
            jsonschema.validate(json.loads(res["text"]), SCHEMA)
    assert passes[True] < 0.8 * passes[False], passes
    jumped = results[smol.engine]
    for res, decoded in zip(jumped, results[no_jump]):
        ours = jumps[res["meta_info"]["id"]]
        _assert_follows_the_constraint(smol.engine, res["output_ids"], constraint, ours)
        _assert_decoding_writes_the_forced_text(smol.engine, res["output_ids"], decoded["output_ids"], ours)
    cold = smol.engine_with(disable_radix_cache=True)
    tok = smol.engine.tokenizer
    follow_ups = [tok.encode(p, add_special_tokens=False) + r["output_ids"] + tok.encode("\nSay it in words:")
                  for p, r in zip(prompts, jumped)]
    greedy = {"max_new_tokens": 12, "temperature": 0}
    warm = smol.engine.generate(input_ids=follow_ups, sampling_params=greedy)
    assert all(r["meta_info"]["cached_tokens"] > len(f) // 2 for r, f in zip(warm, follow_ups))
    assert [r["output_ids"] for r in warm] == [r["output_ids"] for r in cold.generate(input_ids=follow_ups,
                                                                                      sampling_params=greedy)]
    assert_drained(smol.engine)


def _assert_decoding_writes_the_forced_text(engine, jumped: list[int], decoded: list[int], jumps) -> None:
    """Greedy token-by-token decoding (`decoded`) against the same request with jump-forward
    (`jumped`, whose `jumps` were recorded). They decode the same tokens until one a jump wrote
    differs (jump-forward writes the tokenizer's encoding, which decoding need not choose); and
    wherever decoding reached the place a jump started, it wrote the same forced bytes there.
    Their texts may part after that: the model has read different tokens."""
    token_bytes = engine.scheduler.grammar.jump_forward.token_bytes
    eos = engine.scheduler.eos_ids[0]
    raw = lambda ids: b"".join(token_bytes[t] for t in ids if t != eos)  # noqa: E731
    first = common_prefix(jumped, decoded)
    if first < min(len(jumped), len(decoded)):
        assert any(common_prefix(before, after) <= first < len(after) and after[: first + 1] == jumped[: first + 1]
                   for before, after in jumps), f"token {first} differs, and no jump wrote it"
    text = raw(decoded)
    same = common_prefix(raw(jumped), text)
    cut = same == len(text) and decoded[-1] != eos  # decoding ran out of tokens there
    for before, after in jumps:
        start, end = len(raw(before)), len(raw(after))
        assert start > same or end <= same or cut, (
            f"decoding reached byte {start} and wrote {text[start:end]!r}, not the forced {raw(after)[start:]!r}")


def test_jump_forward_under_paging_chunking_and_retraction(smol):
    """Page size 4 (rolled back KV frees whole pages only), small prefill chunks and a pool so
    small that decoding retracts requests: outputs still validate and no page leaks."""
    eng = smol.engine_with(page_size=4, chunked_prefill_size=32, max_total_tokens=256, debug_accounting=True,
                           init_new_token_ratio=0.01, min_new_token_ratio=0.01)  # admit optimistically
    prompts = [_chat(eng, f"Describe person number {i} as JSON.") for i in range(12)]
    results = eng.generate(prompts, {"max_new_tokens": 96, "temperature": 1.0, "seed": 11,
                                     "json_schema": json.dumps(SCHEMA)})
    for res in results:
        jsonschema.validate(json.loads(res["text"]), SCHEMA)
    assert eng.scheduler.jumped_tokens > 0 and eng.scheduler.num_retractions > 0
    assert_drained(eng)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_multibyte_text_stays_valid_utf8(engine, temperature, monkeypatch):
    """Forced text that ends inside a character (é and è share a first byte) is cut at the
    character: the output is always whole UTF-8 that full-matches."""
    rx = "Résumé: (café|cafè|thé) — [a-z]{1,6} ✓"
    jumps = _record_jumps(engine, monkeypatch)
    results = engine.generate([_chat(engine, "Write a note.")] * 3,
                              {"max_new_tokens": 40, "temperature": temperature, "seed": 2, "regex": rx})
    for res in results:
        assert "\ufffd" not in res["text"] and re.fullmatch(rx, res["text"]), res["text"]
        _assert_follows_the_constraint(engine, res["output_ids"], {"regex": rx}, jumps[res["meta_info"]["id"]])
    assert_drained(engine)
