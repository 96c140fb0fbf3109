"""Constraints compiled to outlines-core indexes off the scheduler's critical path, and the
per-step token bitmask of a batch.

A request with `regex` or `json_schema` waits in the scheduler's pending list
while a worker thread builds its Index (cached by constraint, LRU, as a
`Grammar` that also remembers its forced continuations for jump-forward); it
then carries its own `Guide` (the automaton's state), advanced by every token
it samples. Each step the constrained rows of the batch get one bitmask row each;
unconstrained rows stay all-ones.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from runtime.constrained.jump_forward import Grammar, JumpForward
from runtime.sampling_params import SamplingParams

ConstraintKey = tuple[str, str]  # ("regex" | "json_schema", its text)

# `dtype` constraints: a literal of that type (bools and strings as Python writes them)
DTYPE_REGEXES = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?",
    "bool": r"(True|False)",
    "str": r'"([^"\\\n]|\\.)*"',
}


class GrammarError(ValueError):
    """The constraint cannot be used; the message names the problem."""


def constraint_key(params: SamplingParams) -> ConstraintKey | None:
    if params.regex is not None:
        return ("regex", params.regex)
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    if params.dtype is not None:
        return ("regex", DTYPE_REGEXES[params.dtype])
    return None


def to_regex(key: ConstraintKey) -> str:
    kind, text = key
    if kind == "regex":
        return text
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    try:
        regex = build_regex_from_schema(json.dumps(_strict_formats(schema)))
    except Exception as e:  # noqa: BLE001 - outlines-core raises plain exceptions for unsupported schemas
        raise GrammarError(f"unsupported JSON schema: {e}") from None
    # NOTE: outlines-core writes formats (date, time, ...) with \d, which its automaton reads as any
    # Unicode digit ("🯸🯸🯸🯸-10-20" would pass); JSON Schema means ASCII digits.
    return _ASCII_DIGIT.sub(r"\1[0-9]", regex)


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


class GrammarCompiler:
    """Builds Indexes in a thread pool; `poll` answers without waiting."""

    def __init__(self, vocabulary: Vocabulary, workers: int = 2, cache_size: int = 256,
                 timeout_s: float = 60.0, jump_forward: JumpForward | None = None) -> None:
        self.vocabulary = vocabulary
        self.jump_forward = jump_forward
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="radixlm-grammar")
        self._cache: OrderedDict[ConstraintKey, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._compiling: dict[ConstraintKey, tuple[Future, float]] = {}

    def submit(self, key: ConstraintKey) -> None:
        if key in self._cache or key in self._compiling:
            return
        self._compiling[key] = (self._pool.submit(self._compile, key), time.monotonic())

    def _compile(self, key: ConstraintKey) -> Grammar:
        regex = to_regex(key)
        try:
            return Grammar(Index(regex, self.vocabulary))
        except Exception as e:  # noqa: BLE001 - invalid regex, or one no token sequence can match
            raise GrammarError(f"cannot compile the {key[0]} constraint: {e}") from None

    def poll(self, key: ConstraintKey) -> Grammar | GrammarError | None:
        """The Grammar when ready, the error if compiling failed or timed out, else None."""
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        future, started = self._compiling[key]
        if not future.done():
            if time.monotonic() - started > self.timeout_s:
                del self._compiling[key]  # the thread finishes on its own; its result is dropped
                return GrammarError(f"compiling the {key[0]} constraint took more than {self.timeout_s:.0f}s")
            return None
        del self._compiling[key]
        error = future.exception()
        if error is not None:
            return error if isinstance(error, GrammarError) else GrammarError(str(error))
        self._cache[key] = future.result()
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return self._cache[key]

    def wait_any(self, timeout: float) -> None:
        """Block until some compile finishes (or `timeout`): lets an idle scheduler sleep."""
        futures = [f for f, _ in self._compiling.values()]
        if futures:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compiler_factory(tokenizer: object, vocab_size: int, eos_token_ids: Sequence[int]):
    """A zero-argument maker of the GrammarCompiler, for the scheduler to call on first use."""

    def make() -> GrammarCompiler:
        from runtime.constrained.vocabulary import token_bytes, vocabulary_from_bytes

        if not eos_token_ids:
            raise ValueError("constrained decoding needs at least one EOS token id")

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        table = token_bytes(tokenizer, vocab_size, eos_token_ids)  # one pass over the vocabulary, shared
        jump = JumpForward(table, eos_token_ids[0], encode, pre_splitter(tokenizer))
        return GrammarCompiler(vocabulary_from_bytes(table, eos_token_ids[0]), jump_forward=jump)

    return make


def pre_splitter(tokenizer: object) -> Callable[[str], list[int]] | None:
    """Where a fast tokenizer's pre-tokens start (character offsets), or None when it has no
    pre-tokenizer or normalizes text first (offsets would not be into the text itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None or backend.normalizer is not None:
        return None
    return lambda text: [start for _, (start, _) in pre.pre_tokenize_str(text)]


def grammar_bitmask(guides: Sequence[Guide | None], vocab_size: int) -> torch.Tensor | None:
    """[B, ceil(V/32)] int32 bitmask of allowed tokens per row (all ones for unconstrained rows),
    or None when no row is constrained."""
    if all(g is None for g in guides):
        return None
    mask = torch.full((len(guides), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i, guide in enumerate(guides):
        if guide is not None:
            row = mask[i : i + 1]
            guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
    return mask


_BIT = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set disallowed tokens' logits to -inf, in place, in one vectorised operation.

    (outlines-core's own kernel is torch.compile'd: its first call costs ~15 s on a CPU.)"""
    mask = mask.to(logits.device, non_blocking=True)
    bits = (mask.unsqueeze(-1) >> _BIT.to(logits.device)) & 1  # [B, W, 32], bit j of word w is token 32w + j
    allowed = bits.view(mask.shape[0], -1)[:, : logits.shape[-1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
