"""A constraint as the regex its automaton is built from: regexes as given, JSON schemas translated.

Kept free of torch: the compiler process (compile_worker.py) imports it.
"""

from __future__ import annotations

import json
import re

from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from radixlm.runtime.constrained.backend import ConstraintKey, GrammarError


# The end mark: a byte compiled after the regex of the constraints that need it (`uses_end_mark`),
# and the only token that holds it (vocabulary.py adds it, one id past the model's, and leaves out
# real tokens holding the byte). outlines-core 0.2 drops a token's transition when the token's last
# byte leaves an accepting position for a non-accepting one (it reads the DFA's one-byte-delayed
# match flag as "the text so far is a match"): after "3" a float could never take ".", nor free
# text a tool call's opening tag. With the mark, no text position is accepting, so every
# transition is kept; "the text may end here" becomes "the end mark's token may follow"
# (outlines_backend.Grammar.can_end), and OutlinesMatcher.fill_mask allows EOS there.
# NOTE: not for user regexes and JSON schemas: the pruning also keeps their automata small, and a
# regex like `[^\n]{4,100}` compiled with the mark takes minutes instead of a second. A JSON
# value's end is never optional, so schemas do not suffer from the flaw; a user regex with an
# optional tail after a possible end does (`[0-9]+(\.[0-9]+)?` loses its tail one character
# token at a time).
END_MARK = b"\x00"
_MARKED_KINDS = frozenset({"dtype", "structural_tag"})

# `dtype` constraints: a literal of that type (bools and strings as Python writes them)
DTYPE_REGEXES = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?",
    "bool": r"(True|False)",
    "str": r'"([^"\\\n]|\\.)*"',
}


def uses_end_mark(key: ConstraintKey) -> bool:
    return key[0] in _MARKED_KINDS


def build_index(key: ConstraintKey, vocabulary: Vocabulary) -> Index:
    if key[0] == "ebnf":
        raise GrammarError("ebnf grammars need --grammar-backend xgrammar or llguidance (this server runs outlines)")
    regex = to_regex(key)
    try:
        return Index(f"({regex})\\x00" if uses_end_mark(key) else regex, vocabulary)
    except Exception as e:  # noqa: BLE001 - invalid regex, or one no token sequence can match
        raise GrammarError(f"cannot compile the {key[0]} constraint: {e}") from None


def to_regex(key: ConstraintKey) -> str:
    kind, text = key
    if kind == "regex":
        return text
    if kind == "dtype":
        return DTYPE_REGEXES[text]
    if kind == "structural_tag":
        return _structural_tag_regex(text)
    if kind == "json_schema":
        return _schema_regex(_load_json("json_schema", text), "json_schema")
    raise GrammarError(f"{kind} constraints have no regex")


def _load_json(what: str, text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"{what} is not valid JSON: {e}") from None


def load_schema(text: str) -> object:
    """A `json_schema` constraint's schema, parsed and checked (`check_schema`)."""
    schema = _load_json("json_schema", text)
    check_schema(schema, "json_schema")
    return schema


def check_schema(schema: object, what: str) -> None:
    """Refuse up front what no backend should try: a schema that is not an object (or boolean), or
    nests deeper than MAX_SCHEMA_NESTING."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    if _nesting(schema) > MAX_SCHEMA_NESTING:
        raise GrammarError(f"{what} nests objects and arrays more than {MAX_SCHEMA_NESTING} deep")


def _schema_regex(schema: object, what: str) -> str:
    check_schema(schema, what)
    try:
        regex = build_regex_from_schema(json.dumps(_strict_formats(schema)))
    except Exception as e:  # noqa: BLE001 - outlines-core raises plain exceptions for unsupported schemas
        raise GrammarError(f"unsupported JSON schema: {e}") from None
    # NOTE: outlines-core writes formats (date, time, ...) with \d, which its automaton reads as any
    # Unicode digit ("🯸🯸🯸🯸-10-20" would pass); JSON Schema means ASCII digits.
    return _ASCII_DIGIT.sub(r"\1[0-9]", regex)


# ---- structural tags: free text, and JSON where a trigger opens a structure ---------------------


def _structural_tag_regex(text: str) -> str:
    """Free text in which the trigger may only open a structure, whose body must then match its
    schema up to its end (see `structural_tag`); the text around structures is then a small
    automaton (see `text_without`)."""
    trigger, structures = structural_tag(text)
    bodies = "|".join(f"{_literal(s['begin'])}({_schema_regex(s['schema'], 'structural_tag schema')}){_literal(s['end'])}"
                      for s in structures)
    free = text_without(trigger)
    return f"{free}(({bodies}){free})*"


def structural_tag(text: str) -> tuple[str, list[dict]]:
    """SGLang's structural tag, ``{"structures": [{"begin", "schema", "end"}, ...], "triggers":
    [trigger]}``, checked: its trigger and structures. Free text in which the trigger may only
    open a structure; structures may follow one another, with text between.

    One trigger, which every begin starts with and whose first character does not occur in it
    again (``<tool_call>``, ``<function=``, ``[TOOL_CALLS]``): what outlines' regex of the text
    around structures needs; the other backends take the same tags.
    """
    spec = _load_json("structural_tag", text)
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not isinstance(structures, list) or not structures or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), (dict, bool)) for s in structures):
        raise GrammarError('structural_tag needs "structures": a non-empty list of {"begin", "schema", "end"}')
    if not isinstance(triggers, list) or len(triggers) != 1 or not isinstance(triggers[0], str) or not triggers[0]:
        raise GrammarError('structural_tag needs "triggers": one non-empty string')
    (trigger,) = triggers
    if trigger[0] in trigger[1:]:
        raise GrammarError(f"structural_tag trigger {trigger!r} repeats its first character; not supported")
    for s in structures:
        if not s["begin"].startswith(trigger):
            raise GrammarError(f"structural_tag begin {s['begin']!r} does not start with the trigger {trigger!r}")
        check_schema(s["schema"], "structural_tag schema")
    return trigger, structures


def text_without(trigger: str) -> str:
    """A regex for any text that does not contain `trigger`, whose first character must not occur in
    it again: then, after a partial match, a character other than the next one either restarts the
    match (it is the first character) or ends it (anything else)."""
    first, rest = _literal(trigger[0]), trigger[1:]
    if not rest:
        return f"{_not(trigger)}*"
    # `tail`: after `first`, a partial match of `rest` ended by a character that is neither its next
    # one nor `first` (completing `rest` would complete the trigger)
    tail = _not(rest[-1] + trigger[0])
    for ch in reversed(rest[:-1]):
        tail = f"({_not(ch + trigger[0])}|{_literal(ch)}{tail})"
    # `partial`: a proper prefix of `rest`, possibly empty (after which `first` may restart)
    partial = ""
    for ch in reversed(rest[:-1]):
        partial = f"({_literal(ch)}{partial})?"
    restarts = f"({partial}{first})*"
    return f"({_not(trigger[0])}|{first}{restarts}{tail})*({first}{restarts}{partial})?"


# Escapes both Python's re and outlines-core's (Rust) regex read alike.
_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _literal(text: str) -> str:
    """A regex matching `text` as it is."""
    return "".join(_CONTROL.get(c) or ("\\" + c if c in ".^$*+?()[]{}|\\" else c) for c in text)


def _not(chars: str) -> str:
    """A class of any character but `chars`."""
    return "[^" + "".join(_CONTROL.get(c) or ("\\" + c if c in "\\]^-[" else c) for c in dict.fromkeys(chars)) + "]"


# Deeper schemas are refused with this reason up front. Shallower ones can still explode (each
# level of nested arrays quadruples the regex): the compiler process's time and memory limits
# stop those.
MAX_SCHEMA_NESTING = 128


def _nesting(node: object) -> int:
    """How deep JSON containers nest in `node` (iterative: the input may be adversarial)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


_ASCII_DIGIT = re.compile(r"(?<!\\)((?:\\\\)*)\\d")

# RFC 3339, as JSON Schema's date-time and time mean (outlines-core makes the offset optional)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_FORMAT_PATTERNS = {
    "date-time": rf"^[0-9]{{4}}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T{_TIME}$",
    "time": rf"^{_TIME}$",
}


def _strict_formats(node: object) -> object:
    """The schema with `date-time` and `time` strings written as RFC 3339 patterns."""
    if isinstance(node, list):
        return [_strict_formats(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_formats(v) for k, v in node.items()}
    if out.get("format") in _FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = _FORMAT_PATTERNS[out.pop("format")]
    return out
