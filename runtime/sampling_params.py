"""Per-request sampling parameters: the user-facing contract of how to decode.

Construction normalises and type-checks (a ``str`` stop becomes a list, JSON
string keys of ``logit_bias`` become ints); ``validate`` checks ranges, and
token ids against the vocabulary when it is known. ``from_dict`` does both and
is what the HTTP / Engine edge calls on untrusted input.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping


DTYPES = ("int", "float", "bool", "str")
# The fields that constrain the output's form, at most one per request (each compiles to an automaton)
CONSTRAINTS = ("regex", "json_schema", "ebnf", "dtype", "structural_tag")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of the n drawn for one request with `seed`. Sample 0 keeps the
    seed (so it is the n=1 result); the others get streams of their own, the same run to run."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


class SamplingParamsError(ValueError):
    """Sampling parameters a user sent are malformed or out of range."""


_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    # HF semantics over prompt + output tokens: positive logits divided,
    # negative logits multiplied.
    repetition_penalty: float = 1.0
    # OpenAI semantics over output tokens: logit -= f * count, logit -= p * (count > 0).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Python regexes searched in the output text; as in SGLang the match stays in the text and
    # the finish reason's `matched` is the pattern
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False  # keep a matched stop string at the end of the text
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constraints (runtime/constrained/); at most one may be set.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # a grammar in xgrammar's EBNF (SGLang's parameter)
    dtype: str | None = None  # one of DTYPES: the output is a literal of that type
    # SGLang's: free text in which a trigger opens structures whose bodies follow JSON schemas (tool calls)
    structural_tag: str | None = None
    n: int = 1
    stream_interval: int = 1  # a streamed request gets a chunk every this many tokens (and at the end)
    # SGLang's data for custom logit processors: kept with the request (none run here yet)
    custom_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            setattr(self, name, _as_bool(name, getattr(self, name)))
        self.seed = None if self.seed is None else _as_int("seed", self.seed)
        self.stop = _as_str_list("stop", self.stop)
        self.stop_regex = _as_str_list("stop_regex", self.stop_regex)
        self.custom_params = _as_custom_params(self.custom_params)
        self.stop_token_ids = _as_token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _as_logit_bias(self.logit_bias)
        self.regex = _as_optional_str("regex", self.regex)
        self.json_schema = _as_json_text("json_schema", self.json_schema)
        self.ebnf = _as_optional_str("ebnf", self.ebnf)
        self.structural_tag = _as_json_text("structural_tag", self.structural_tag)
        self.dtype = _as_optional_str("dtype", self.dtype)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Parse and validate untrusted input; ``None`` gives the defaults.

        A field whose value is ``None`` (JSON ``null``) takes its default.
        Raises ``SamplingParamsError`` for unknown fields, wrong types and
        out-of-range values, naming the field.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise SamplingParamsError(
                f"sampling params must be an object, got {type(d).__name__}"
            )
        d = _resolve_aliases(d)
        refused = [name for name in UNSUPPORTED if d.get(name) is not None]
        if refused:
            raise SamplingParamsError(f"{refused[0]} is not supported: radixlm has no {UNSUPPORTED[refused[0]]}")
        allowed = field_names()
        unknown = [k for k in d if k not in allowed and k not in UNSUPPORTED]
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(sorted(allowed | set(ALIASES)))}"
            )
        params = cls(**{k: v for k, v in d.items() if v is not None and k in allowed})
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Range checks; token ids must lie in ``[0, vocab_size)`` when given."""
        _require(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        _require(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            self.min_new_tokens,
            f">= 0 and <= max_new_tokens ({self.max_new_tokens})",
        )
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 = greedy)")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (off) or >= 1")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, name, value, "in [-2, 2]")
        _require(self.n >= 1, "n", self.n, ">= 1")
        _require(self.stream_interval >= 1, "stream_interval", self.stream_interval, ">= 1")
        if "" in self.stop:
            raise SamplingParamsError("stop strings must be non-empty; got an empty string in stop")
        for pattern in self.stop_regex:
            _check_stop_regex(pattern)
        constraints = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        if len(constraints) > 1:
            raise SamplingParamsError(f"{' and '.join(constraints)} are mutually exclusive; set at most one")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SamplingParamsError(f"dtype={self.dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        self._validate_token_ids(vocab_size)

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        bound = "in [0, vocab_size)" if vocab_size is None else f"in [0, {vocab_size})"
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            bad = [tid for tid in ids if tid < 0 or (vocab_size is not None and tid >= vocab_size)]
            if bad:  # every one is named, not only the first
                raise SamplingParamsError(f"{name} token id(s) {', '.join(map(str, bad))} out of range; "
                                          f"allowed: {bound}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether the token counts of the context change this request's logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def to_dict(self) -> dict[str, Any]:
        """A deep copy as plain Python values; ``from_dict`` round-trips it."""
        return asdict(self)


# SGLang's names for fields that have another name here
ALIASES = {"sampling_seed": "seed"}
# SGLang sampling parameters for features radixlm does not have: refused when set
UNSUPPORTED = {"beam_width": "beam search", "watermark": "watermarking"}
# A stop regex is searched in at most this many of the output's last characters (and tokens)
STOP_REGEX_WINDOW = 256


def field_names() -> frozenset[str]:
    """Names ``SamplingParams.from_dict`` accepts."""
    return frozenset(f.name for f in fields(SamplingParams))


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise SamplingParamsError(f"{name}={value!r} is out of range; allowed: {allowed}")


def _type_error(name: str, expected: str, value: Any) -> SamplingParamsError:
    return SamplingParamsError(
        f"{name} must be {expected}, got {type(value).__name__} {value!r}"
    )


def _as_int(name: str, value: Any) -> int:
    # bool is an int subclass; `"max_new_tokens": true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _type_error(name, "an integer", value)
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(name, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be finite, got {value!r}")
    return value


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _as_optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def _as_json_text(name: str, value: Any) -> str | None:
    # JSON clients naturally send a schema (or tag) as an object; carry it as text.
    if isinstance(value, Mapping):
        return json.dumps(value)
    return _as_optional_str(name, value)


def _resolve_aliases(d: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for alias, name in ALIASES.items():
        value = out.pop(alias, None)
        if value is None:
            continue
        if out.get(name) is not None and out[name] != value:
            raise SamplingParamsError(f"{alias}={value!r} and {name}={out[name]!r} disagree; {alias} is SGLang's "
                                      f"name for {name}: give one")
        out[name] = value
    return out


def _as_str_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise _type_error(name, "a string or a list of strings", value)
    return list(value)


def _check_stop_regex(pattern: str) -> None:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise SamplingParamsError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    if compiled.search("") is not None:
        raise SamplingParamsError(f"stop_regex {pattern!r} matches the empty string, so it would stop at once")


def _as_custom_params(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _type_error("custom_params", "an object with string keys", value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise _type_error("custom_params", "JSON values", value) from None
    return dict(value)


def _as_token_ids(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _type_error(name, "a list of integers", value)
    return [_as_int(name, v) for v in value]


def _token_id_key(key: Any) -> int | None:
    """A logit_bias key as a token id, or None if it is not one."""
    # JSON object keys are always strings, so "50256" must mean token 50256.
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        return None
    return int(key)


def _as_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _type_error("logit_bias", "an object mapping token id to bias", value)
    ids = {k: _token_id_key(k) for k in value}
    not_ids = [k for k, tid in ids.items() if tid is None]
    if not_ids:  # every one is named, not only the first
        raise SamplingParamsError(f"logit_bias keys must be token ids, got {', '.join(map(repr, not_ids))}")
    return {ids[k]: _as_float("logit_bias value", v) for k, v in value.items()}
