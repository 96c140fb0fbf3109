"""Every `--grammar-backend` serving SmolLM2: regex and JSON-schema outputs hold to their
constraints with jump-forward on (every jump appending only forced text), EBNF where the backend
has it, bad constraints refused beside good ones, and the KV accounting clean afterwards."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from helpers import assert_drained
from radixlm.runtime.args import GRAMMAR_BACKENDS, ServerArgs
from test_constrained import _assert_follows_the_constraint, _chat, _record_jumps

DEFAULT = ServerArgs().grammar_backend

REGEXES = [r"\d{4}-\d{2}-\d{2}", r"(yes|no|maybe)", r"[a-z]{1,8}(, [a-z]{1,8}){2}", r"[0-9]{1,4}(\.[0-9]{1,2})?"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "colour"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
]
EBNF = 'root ::= ("yes" | "no") ", because " [a-z]+ "."'  # the regex below, in xgrammar's EBNF
EBNF_REGEX = r"(yes|no), because [a-z]+\."


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def engine(request, smol):
    if request.param == DEFAULT:
        return smol.engine
    return smol.engine_with(grammar_backend=request.param, max_total_tokens=4096)


def test_constrained_outputs_hold_with_jump_forward(engine, monkeypatch):
    backend = engine.args.grammar_backend
    jumps = _record_jumps(engine, monkeypatch)
    jumped = engine.scheduler.jumped_tokens
    requests = ([(f"Give an example matching {rx}.", {"regex": rx}) for rx in REGEXES]
                + [("Answer in JSON: describe something.", {"json_schema": json.dumps(s)}) for s in SCHEMAS]
                + [("Is the sea salty? Say yes or no and why.", {"ebnf": EBNF}),
                   ("x", {"regex": "(unclosed"}), ("y", {"json_schema": '{"type": "nope"}'})])
    results = engine.generate([_chat(engine, p) for p, _ in requests],
                              [{"max_new_tokens": 48 if "json_schema" in c else 24, "temperature": 0, **c}
                               for _, c in requests])
    refused = {"(unclosed": "regex", '{"type": "nope"}': "nope"}  # each 400 names what was wrong
    if backend == "outlines":
        refused[EBNF] = "ebnf grammars need --grammar-backend xgrammar or llguidance"
    for (_, constraint), res in zip(requests, results):
        kind, text = next(iter(constraint.items()))
        finish = res["meta_info"]["finish_reason"]
        if text in refused:
            assert finish["type"] == "abort" and finish["status"] == 400, finish
            assert refused[text] in finish["message"], finish
            continue
        assert finish["type"] == "stop", (backend, constraint, res["text"])
        if kind == "json_schema":
            jsonschema.validate(json.loads(res["text"]), json.loads(text))
        else:
            assert re.fullmatch(text if kind == "regex" else EBNF_REGEX, res["text"]), (backend, res["text"])
        _assert_follows_the_constraint(engine, res["output_ids"], constraint, jumps[res["meta_info"]["id"]])
    assert engine.scheduler.jumped_tokens > jumped, "the JSON keys were meant to be jumped"
    assert_drained(engine)


def test_the_default_backend_writes_an_optional_tail_after_a_possible_end(smol):
    """`a(b)?` with the model pushed towards `b`: outlines-core alone never allows the `b` after `a`
    (constraint_regex.END_MARK); the default backend must."""
    engine = smol.engine
    b = engine.tokenizer.encode("b", add_special_tokens=False)
    res = engine.generate(_chat(engine, "Write ab."), {"max_new_tokens": 4, "temperature": 0, "regex": "a(b)?",
                                                      "logit_bias": {str(b[0]): 50.0}})
    assert res["text"] == "ab", res["text"]
    assert_drained(engine)
