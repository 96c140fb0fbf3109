"""A constraint as the regex its automaton is built from: regexes as given, JSON schemas translated.

Kept free of torch: the compiler process (compile_worker.py) imports it.
"""

from __future__ import annotations

import json
import re

from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

ConstraintKey = tuple[str, str]  # ("regex" | "json_schema", its text)


class GrammarError(ValueError):
    """The constraint cannot be used; the message names the problem."""


def build_index(key: ConstraintKey, vocabulary: Vocabulary) -> Index:
    regex = to_regex(key)
    try:
        return Index(regex, vocabulary)
    except Exception as e:  # noqa: BLE001 - invalid regex, or one no token sequence can match
        raise GrammarError(f"cannot compile the {key[0]} constraint: {e}") from None


def to_regex(key: ConstraintKey) -> str:
    kind, text = key
    if kind == "regex":
        return text
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if _nesting(schema) > MAX_SCHEMA_NESTING:
        raise GrammarError(f"json_schema nests objects and arrays more than {MAX_SCHEMA_NESTING} deep")
    try:
        regex = build_regex_from_schema(json.dumps(_strict_formats(schema)))
    except Exception as e:  # noqa: BLE001 - outlines-core raises plain exceptions for unsupported schemas
        raise GrammarError(f"unsupported JSON schema: {e}") from None
    # NOTE: outlines-core writes formats (date, time, ...) with \d, which its automaton reads as any
    # Unicode digit ("🯸🯸🯸🯸-10-20" would pass); JSON Schema means ASCII digits.
    return _ASCII_DIGIT.sub(r"\1[0-9]", regex)


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
