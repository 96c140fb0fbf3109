"""Structural tags: free text in which a trigger may only open a structure whose body follows a schema."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.constrained.backend import GrammarError
from radixlm.runtime.constrained.constraint_regex import text_without, to_regex
from radixlm.runtime.constrained.grammar import GrammarCompiler, grammar_bitmask
from radixlm.runtime.constrained.outlines_backend import OutlinesBackend
from radixlm.runtime.token_mask import apply_bitmask

TOKENS = ["<", "c", ">", "<c>", "1", "2", "}", "x", " "]
EOS = 0
TABLE = [None] + [t.encode() for t in TOKENS]  # token i + 1 is TOKENS[i]
ID = {t: i + 1 for i, t in enumerate(TOKENS)}
TAG = json.dumps({"type": "structural_tag", "triggers": ["<c>"],
                  "structures": [{"begin": "<c>", "schema": {"type": "integer"}, "end": "}"}]})


@settings(max_examples=500)
@given(trigger=st.sampled_from(["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "ab", "<"]), data=st.data())
def test_text_without_a_trigger_is_exactly_the_text_that_lacks_it(trigger, data):
    pieces = st.sampled_from([trigger, trigger[:-1], trigger[:2], trigger[0], trigger[1:], "x", "\n", "]"])
    text = "".join(data.draw(st.lists(pieces, max_size=8)))
    assert (re.fullmatch(text_without(trigger), text) is not None) == (trigger not in text)


@pytest.mark.parametrize("tag,fragment", [
    ({"structures": [], "triggers": ["<c>"]}, "structures"),
    ({"structures": [{"begin": "<c>", "schema": {}, "end": "}"}]}, "triggers"),
    ({"structures": [{"begin": "<c>", "schema": {}, "end": "}"}], "triggers": ["<c>", "<d>"]}, "triggers"),
    ({"structures": [{"begin": "<<", "schema": {}, "end": "}"}], "triggers": ["<<"]}, "repeats its first character"),
    ({"structures": [{"begin": "<d>", "schema": {}, "end": "}"}], "triggers": ["<c>"]}, "does not start with"),
    ({"structures": [{"begin": "<c>", "schema": {"type": "nope"}, "end": "}"}], "triggers": ["<c>"]}, "schema"),
])
def test_bad_tags_are_refused_with_a_reason(tag, fragment):
    with pytest.raises(GrammarError, match=fragment):
        to_regex(("structural_tag", json.dumps(tag)))


def test_text_is_free_until_the_trigger_and_the_body_follows_its_schema():
    compiler = GrammarCompiler(OutlinesBackend(TABLE, EOS), workers=1)
    try:
        compiler.submit(("structural_tag", TAG))
        while (grammar := compiler.poll(("structural_tag", TAG))) is None:
            time.sleep(0.01)
        matcher = compiler.matcher(grammar)

        def allowed() -> set[str]:
            logits = torch.zeros(1, len(TABLE))
            apply_bitmask(logits, grammar_bitmask([matcher], len(TABLE)))
            return {"EOS" if i == EOS else TOKENS[i - 1] for i in torch.isfinite(logits[0]).nonzero().flatten().tolist()}

        def feed(*tokens: str) -> None:
            for t in tokens:
                matcher.advance(ID[t])

        everything = set(TOKENS) | {"EOS"}
        assert allowed() == everything  # free text may hold anything, and may end
        feed("x", "<", "c")  # "<c" is still text
        assert allowed() == everything
        feed(">")  # the trigger, token by token: a body must follow
        assert allowed() == {"1", "2"}
        feed("1", "2")
        assert allowed() == {"1", "2", "}"}  # no EOS inside a structure
        feed("}", " ")
        assert allowed() == everything
        feed("<c>")  # the trigger as one token
        assert allowed() == {"1", "2"}
    finally:
        compiler.shutdown()
