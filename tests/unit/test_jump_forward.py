"""Jump-forward's forced text and boundary re-encoding, on SmolLM2's tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest
from outlines_core import Guide

from radixlm.runtime.constrained.constraint_regex import build_index

from radixlm.runtime.constrained.grammar import compiler_factory
from radixlm.runtime.constrained.outlines_backend import Grammar


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
    c = compiler_factory(tok, len(tok), [tok.eos_token_id], backend="outlines")()
    yield c
    c.shutdown()


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def walk(compiler, tok, regex: str, text: str) -> tuple[Grammar, Guide]:
    """A guide for `regex` after the canonical tokens of `text`."""
    grammar = Grammar(build_index(("regex", regex), compiler.backend.vocabulary))
    guide = Guide(grammar.index, max_rollback=8)
    for t in encode(tok, text):
        guide.advance(t, return_tokens=False)
    return grammar, guide


def test_forced_text_stops_where_the_constraint_branches(compiler, tok):
    fw = compiler.backend.walk
    grammar, guide = walk(compiler, tok, r'\{"name": "[a-z]+", "age": (1|2)[0-9]\}', "")
    forced = fw.forced(grammar, guide.get_state())
    assert forced.text == b'{"name": "' and not forced.ends
    grammar, guide = walk(compiler, tok, r'\{"name": "[a-z]+", "age": (1|2)[0-9]\}', '{"name": "bob')
    assert fw.forced(grammar, guide.get_state()).text == b""  # more letters or the closing quote
    grammar, guide = walk(compiler, tok, r'\{"name": "[a-z]+", "age": (1|2)[0-9]\}', '{"name": "bob"')
    assert fw.forced(grammar, guide.get_state()).text == b', "age": '
    grammar, guide = walk(compiler, tok, r'\{"name": "[a-z]+", "age": (1|2)[0-9]\}', '{"name": "bob", "age": 13')
    forced = fw.forced(grammar, guide.get_state())
    assert forced.text == b"}" and forced.ends
    grammar, guide = walk(compiler, tok, r"[0-9]+", "12")  # may end or go on: nothing is forced
    forced = fw.forced(grammar, guide.get_state())
    assert forced.text == b"" and not forced.ends


def test_forced_text_of_shared_lead_bytes_stops_at_a_whole_character(compiler, tok):
    jf, fw = compiler.jump_forward, compiler.backend.walk
    grammar, guide = walk(compiler, tok, "x; (é|è)!", "x")
    forced = fw.forced(grammar, guide.get_state())
    assert forced.text == b"; \xc3"  # é and è share their first byte
    plan = jf.retokenize(encode(tok, "x"), forced.text)
    assert tok.decode(encode(tok, "x")[: plan.keep] + plan.tokens) == "x;"  # not the lone lead byte


def test_boundary_is_re_encoded_as_the_tokenizer_would(compiler, tok):
    jf = compiler.jump_forward
    sampled = encode(tok, "{")
    plan = jf.retokenize(sampled, b'"name": "')
    # `{` + `"` merge; the forced text's last pre-token (` "`) is left for the model to sample
    assert plan.keep == 0
    assert plan.tokens == encode(tok, '{"name":')
    # the end of a constraint is appended whole
    plan = jf.retokenize(encode(tok, " 13"), b"}", final=True)
    assert encode(tok, " 13")[: plan.keep] + plan.tokens == encode(tok, " 13}")


def test_untouched_tail_tokens_are_kept(compiler, tok):
    jf = compiler.jump_forward
    tail = encode(tok, 'Hello world, "bob"')
    plan = jf.retokenize(tail, b', "age": ')
    assert tail[: plan.keep] + plan.tokens == encode(tok, 'Hello world, "bob", "age":')
    assert plan.keep >= len(tail) - 1


def test_nothing_to_add_or_no_round_trip_means_no_jump(compiler, tok):
    jf = compiler.jump_forward
    assert jf.retokenize(encode(tok, "{"), b'"') is None  # all forced text is in the last pre-token
    assert jf.retokenize(encode(tok, "x"), b"\xff\xfe") is None  # not UTF-8


def test_a_last_pre_token_nothing_can_join_is_appended(compiler, tok):
    jf, fw = compiler.jump_forward, compiler.backend.walk
    grammar, guide = walk(compiler, tok, r'\["(yes|no)"\]', "[")
    forced = fw.forced(grammar, guide.get_state())
    assert forced.text == b'"' and forced.next_bytes == frozenset(b"ny")
    plan = jf.retokenize(encode(tok, "["), forced.text, next_bytes=forced.next_bytes)
    assert plan.keep == 0 and plan.tokens == encode(tok, '["')  # a letter never joins `["`
    assert jf.retokenize(encode(tok, "["), b'"', next_bytes=frozenset(b"y:")) is None  # `":` would


def test_a_regex_that_admits_a_nul_byte_still_walks(compiler, tok):
    """The vocabulary holds the end mark's token (a NUL, one id past the model's): a regex without
    the mark that admits any character allows it, and the walk must pass over it."""
    grammar, guide = walk(compiler, tok, r"[^\n]{2,5}", "ab")
    assert compiler.backend.end_token in guide.get_tokens()
    forced = compiler.backend.walk.forced(grammar, guide.get_state())
    assert forced.text == b"" and not forced.ends
