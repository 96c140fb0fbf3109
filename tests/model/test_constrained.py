"""Constrained decoding (regex, JSON schema) on SmolLM2: every output satisfies its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from helpers import assert_drained

REGEXES = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "yes-no": r"(yes|no|maybe)",
    "word-list": r"[a-z]+(, [a-z]+){2}",
}

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}}, "required": ["ok", "score"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
     "required": ["city", "tags"]},
]


def _chat(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_full_match_in_a_mixed_batch(smol, temperature):
    engine = smol.engine
    prompts = [_chat(engine, f"Give an example of a {name}.") for name in REGEXES]
    params = [{"max_new_tokens": 40, "temperature": temperature, "seed": 3, "regex": rx} for rx in REGEXES.values()]
    free_prompt = _chat(engine, "Say hello.")
    alone = engine.generate(free_prompt, {"max_new_tokens": 12, "temperature": 0})
    results = engine.generate(prompts + [free_prompt], params + [{"max_new_tokens": 12, "temperature": 0}])
    for (name, rx), res in zip(REGEXES.items(), results):
        assert re.fullmatch(rx, res["text"]), f"{name}: {res['text']!r}"
        # sampling may still be inside an open-ended part (e.g. a long word) when max_new_tokens runs out
        assert res["meta_info"]["finish_reason"]["type"] == "stop" or temperature > 0
    assert results[-1]["output_ids"] == alone["output_ids"], "an unconstrained neighbour must be untouched"
    assert_drained(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(smol, temperature):
    engine = smol.engine
    prompts = [_chat(engine, "Answer in JSON: describe something.") for _ in SCHEMAS]
    params = [{"max_new_tokens": 120, "temperature": temperature, "seed": 5, "json_schema": json.dumps(s)}
              for s in SCHEMAS]
    for schema, res in zip(SCHEMAS, engine.generate(prompts, params)):
        assert res["meta_info"]["finish_reason"]["type"] == "stop", res
        jsonschema.validate(json.loads(res["text"]), schema)
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
