"""`--grammar-backend xgrammar`: constraints compiled by xgrammar (a pushdown automaton over
byte-level rules, with a per-state cache of the tokens that are allowed whatever the stack holds)
in the compiler process, masks filled by its batch matcher's native threads.

In the compiler process, where the time limit and memory cap hold: xgrammar compiles most
constraints in milliseconds and drops the GIL, but nothing bounds its work (a repetition like
``[^\\n]{4,1000}`` takes a second or more, benchmarks/README.md). The compiled grammar comes
back serialized (xgrammar's JSON form: a few milliseconds each way). `ebnf` is xgrammar's EBNF
(GBNF-like, ``root ::= ...``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xgrammar

from radixlm.runtime.constrained.backend import (
    Builder, ConstraintKey, CountedMatcher, GrammarBackend, GrammarError, Matcher,
)
from radixlm.runtime.constrained.constraint_regex import DTYPE_REGEXES, load_schema, structural_tag
from radixlm.runtime.constrained.jump_forward import Forced
from radixlm.runtime.token_mask import allocate_mask, forbid_token


def _tokenizer_info(table: Sequence[bytes | None], eos_token_id: int) -> xgrammar.TokenizerInfo:
    # an empty token is one xgrammar never allows (it takes those for specials); EOS is its stop token
    return xgrammar.TokenizerInfo([raw or b"" for raw in table], xgrammar.VocabType.RAW, vocab_size=len(table),
                                  stop_token_ids=[eos_token_id])


class XGrammarBuilder(Builder):
    """Sent to the compiler process as the vocabulary's bytes; xgrammar's compiler is made there,
    as it is unpickled."""

    def __init__(self, table: Sequence[bytes | None], eos_token_id: int) -> None:
        self.__setstate__((list(table), eos_token_id))

    def __getstate__(self) -> tuple[list[bytes | None], int]:
        return self.table, self.eos_token_id

    def __setstate__(self, state: tuple[list[bytes | None], int]) -> None:
        self.table, self.eos_token_id = state
        # one thread, no cache: the GrammarCompiler above caches, and a process builds one at a time
        self._compiler = xgrammar.GrammarCompiler(_tokenizer_info(*state), max_threads=1, cache_enabled=False)

    def build(self, key: ConstraintKey) -> str:
        """`key` compiled, in xgrammar's serialized form."""
        try:
            return self._compile(key).serialize_json()
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors are RuntimeErrors
            raise GrammarError(f"cannot compile the {key[0]} constraint: {_first_line(e)}") from None

    def _compile(self, key: ConstraintKey) -> xgrammar.CompiledGrammar:
        kind, text = key
        compiler = self._compiler
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "dtype":
            return compiler.compile_regex(DTYPE_REGEXES[text])
        if kind == "json_schema":
            return compiler.compile_grammar(_schema_grammar(load_schema(text)))
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            trigger, structures = structural_tag(text)
            # each body as the grammar of its schema in the layout above (xgrammar's own json_schema
            # content would allow any whitespace)
            tags = [{"type": "tag", "begin": s["begin"], "end": s["end"], "content": {
                "type": "grammar", "grammar": str(_schema_grammar(s["schema"]))}} for s in structures]
            return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": [trigger], "tags": tags}}))
        raise GrammarError(f"unknown constraint {kind!r}")


def _schema_grammar(schema: object) -> xgrammar.Grammar:
    """The grammar of JSON texts that satisfy `schema` in outlines' layout: ", " and ": ", no other
    whitespace (a small model given any whitespace may spend its tokens on newlines)."""
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _first_line(error: Exception) -> str:
    """xgrammar's message without its C++ source location (``[time] file.cc:94: ...``)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    head, sep, rest = text.partition(".cc:")
    return rest.partition(": ")[2] if sep else text


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, table: Sequence[bytes | None], eos_token_id: int) -> None:
        super().__init__(XGrammarBuilder(table, eos_token_id))
        self.info = _tokenizer_info(table, eos_token_id)
        self.eos_token_id = eos_token_id
        self.batch = xgrammar.BatchGrammarMatcher()  # the native threads that fill a step's rows

    def load(self, key: ConstraintKey, built: str) -> xgrammar.CompiledGrammar:
        return xgrammar.CompiledGrammar.deserialize_json(built, self.info)

    def matcher(self, grammar: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(grammar), self)


class XGrammarMatcher(CountedMatcher):
    def __init__(self, matcher: xgrammar.GrammarMatcher, backend: XGrammarBackend) -> None:
        self.matcher = matcher
        self._backend = backend

    @classmethod
    def fill_masks(cls, rows: Sequence[tuple[int, Matcher]], mask: Any) -> None:
        backend = rows[0][1]._backend
        backend.batch.batch_fill_next_token_bitmask([m.matcher for _, m in rows], mask, [i for i, _ in rows])

    def fill_mask(self, row: Any) -> None:
        self.matcher.fill_next_token_bitmask(row)

    def _advance(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")

    def accepts(self, tokens: Sequence[int]) -> bool:
        taken = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return taken == len(tokens)

    def can_end(self) -> bool:
        return self.matcher.is_completed()

    def _rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    def forced(self) -> Forced:
        text = self.matcher.find_jump_forward_string().encode()
        return Forced(text, ends=not text and self.can_end() and self._only_eos())

    def _only_eos(self) -> bool:
        """Whether EOS is the one token allowed next (xgrammar says only that the text may end)."""
        row = allocate_mask(1, self._backend.info.vocab_size, allowed=False)
        self.matcher.fill_next_token_bitmask(row)
        forbid_token(row, self._backend.eos_token_id)
        return not bool(row.any())
