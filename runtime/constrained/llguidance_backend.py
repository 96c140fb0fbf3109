"""`--grammar-backend llguidance`: constraints compiled by llguidance (Microsoft's Rust
Earley parser over lazily built lexer automata) in the scheduler's process, and masks filled by
its native thread pool, all rows of a step in one call.

In-process: building a matcher takes about a millisecond even for the constraints that explode
outlines' automata ((a|b)*a(a|b){40}, 40 nested arrays; benchmarks/README.md), and llguidance
bounds its own work per grammar and per token (`LLParserLimits`): a constraint past them fails
with an error instead of running on. `ebnf` is read as Lark (llguidance's own syntax, detected)
or GBNF / xgrammar-style EBNF (``root ::= ...``, converted by llguidance), as SGLang does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import llguidance

from radixlm.runtime.constrained.backend import (
    Builder, ConstraintKey, CountedMatcher, GrammarBackend, GrammarError, Matcher,
)
from radixlm.runtime.constrained.constraint_regex import DTYPE_REGEXES, load_schema, structural_tag
from radixlm.runtime.constrained.jump_forward import Forced

# outlines' JSON layout: one space after "," and ":", no other whitespace
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class _Tokens:
    """The vocabulary as llguidance's TokenizerWrapper reads it: every id's bytes (specials and
    ids a constraint never allows marked special, 0xFF first) and the tokenizer for its own
    re-encoding."""

    def __init__(self, table: Sequence[bytes | None], eos_token_id: int, encode: Callable[[str], list[int]]) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.tokens = [raw if raw else b"\xff[%d]" % i for i, raw in enumerate(table)]
        self.special_token_ids = [i for i, raw in enumerate(table) if not raw]
        self._encode = encode

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace"))


class LLGuidanceBuilder(Builder):
    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer

    def build(self, key: ConstraintKey) -> str:
        """The llguidance grammar of `key`, checked against the vocabulary."""
        grammar = _grammar(key)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"cannot compile the {key[0]} constraint: {_one_line(error)}")
        return grammar


def _one_line(error: str) -> str:
    """llguidance's message (which points at the place over several lines) as one line."""
    return " ".join(line.strip() for line in error.splitlines() if line.strip())


def _grammar(key: ConstraintKey) -> str:
    kind, text = key
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "dtype":
        return llguidance.LLMatcher.grammar_from_regex(DTYPE_REGEXES[text])
    if kind == "json_schema":
        return _from_schema(load_schema(text))
    if kind == "ebnf":
        try:
            return llguidance.grammar_from("ebnf", text)
        except ValueError as e:
            raise GrammarError(f"cannot read the ebnf grammar: {e}") from None
    if kind == "structural_tag":
        trigger, structures = structural_tag(text)
        tags = [llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=_with_options(s["schema"]),
                                     end=s["end"]) for s in structures]
        # assume_special=False: a trigger like <tool_call> is text here, not one special token
        return llguidance.StructTag.to_grammar(tags, assume_special=False)
    raise GrammarError(f"unknown constraint {kind!r}")


def _from_schema(schema: object) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_closed(schema)), defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"unsupported JSON schema: {e}") from None


def _with_options(schema: object) -> object:
    """A structure's schema with the JSON layout of `json_schema` constraints."""
    schema = _closed(schema)
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}


_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values there are JSON data, not schemas


def _closed(node: object) -> object:
    """The schema with objects closed where it leaves them open by default: no properties besides
    those named, unless `additionalProperties` says otherwise. Outlines and xgrammar (strict mode)
    read schemas so; llguidance follows JSON Schema, where a small model then invents keys."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS or k == "properties" else _closed(v) for k, v in node.items()}
    if isinstance(node.get("properties"), dict):
        out["properties"] = {name: _closed(v) for name, v in node["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    in_process = True

    def __init__(self, table: Sequence[bytes | None], eos_token_id: int, encode: Callable[[str], list[int]]) -> None:
        tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(table, eos_token_id, encode)),
                                           n_vocab=len(table))
        super().__init__(LLGuidanceBuilder(tokenizer))
        self.tokenizer = tokenizer
        self.executor = llguidance.LLExecutor()  # the native threads that fill a step's rows

    def load(self, key: ConstraintKey, built: str) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar, never advanced: each request's is a copy of it."""
        template = llguidance.LLMatcher(self.tokenizer, built, log_level=0)
        if template.is_error():
            raise GrammarError(f"cannot compile the {key[0]} constraint: {_one_line(template.get_error())}")
        return template

    def matcher(self, grammar: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(grammar.deep_copy(), self.executor)


class LLGuidanceMatcher(CountedMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor) -> None:
        self.matcher = matcher
        self._executor = executor

    @classmethod
    def fill_masks(cls, rows: Sequence[tuple[int, Matcher]], mask: Any) -> None:
        # NOTE: llguidance writes whole rows at mask's address: it must be contiguous [B, W] int32
        assert mask.is_contiguous() and mask.element_size() == 4
        executor = rows[0][1]._executor
        executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in rows], mask.data_ptr(), mask.shape[1] * 4,
                                         mask.shape[0])

    def fill_mask(self, row: Any) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def _advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"llguidance refused token {token}: {self.matcher.get_error()}")

    def accepts(self, tokens: Sequence[int]) -> bool:
        return self.matcher.validate_tokens(list(tokens)) == len(tokens)

    def can_end(self) -> bool:
        return self.matcher.is_accepting()

    def _rollback(self, n: int) -> None:
        if not self.matcher.rollback(n):  # (its result checked here, never inside an assert)
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.matcher.get_error()}")

    def forced(self) -> Forced:
        text = self.matcher.compute_ff_bytes()
        return Forced(text, ends=not text and self.matcher.is_stopped())
