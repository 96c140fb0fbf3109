"""What the scheduler needs of a grammar library, whichever one compiles the constraints
(`--grammar-backend`): a compiled constraint per key, shared by every request that asks for it,
and per request a `Matcher`, its place in that constraint.

A backend compiles a key in two halves: `Builder.build` turns the key into something picklable
(it may run in the compiler process, compile_worker.py, where a time limit and a memory cap hold)
and `GrammarBackend.load` turns that into the compiled grammar in the scheduler's process. Each
step the batch's matchers write their rows of one bitmask (`Matcher.fill_masks`: one call per
matcher class, so a library that fills many rows at once in native threads does; the layout is
token_mask.py's). Each backend's module imports its library only when that backend is made
(grammar.make_backend).

Kept free of torch and of the backends: the compiler process (compile_worker.py) imports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from radixlm.runtime.constrained.jump_forward import Forced
from radixlm.runtime.sampling_params import CONSTRAINTS, SamplingParams

ConstraintKey = tuple[str, str]  # (kind: one of sampling_params.CONSTRAINTS, its text)


def constraint_key(params: SamplingParams) -> ConstraintKey | None:
    """(kind, text) of the request's constraint (validation leaves at most one), or None."""
    for kind in CONSTRAINTS:
        text = getattr(params, kind)
        if text is not None:
            return (kind, text)
    return None


class GrammarError(ValueError):
    """The constraint cannot be used; the message names the problem."""


class Matcher(ABC):
    """One request's position in its compiled constraint.

    Contract (the same on every backend, so that a wrapper may stand in front of any of them,
    e.g. one that allows everything until a reasoning block ends and then delegates):
    - `fill_masks` writes, for each (row, matcher), the tokens allowed next as bits of that row of
      an int32 ``[B, ceil(V/32)]`` CPU tensor (bit j of word w is token 32w + j): EOS (the
      backend's first EOS id) exactly where the text may end, never the model's other specials.
    - `advance` takes one sampled token, never EOS (the scheduler does not feed it EOS).
    - `rollback(n)` undoes the last n advanced tokens, n <= `max_rollback`.
    - `forced()` is the text the constraint admits next whatever the model does (jump-forward).
    """

    @classmethod
    def fill_masks(cls, rows: Sequence[tuple[int, Matcher]], mask: Any) -> None:
        """Write each matcher's allowed tokens into `mask[row]` (rows start all ones)."""
        for i, matcher in rows:
            matcher.fill_mask(mask[i : i + 1])

    @abstractmethod
    def fill_mask(self, row: Any) -> None:
        """The allowed tokens into `row`, a contiguous ``[1, W]`` int32 view."""

    @abstractmethod
    def advance(self, token: int) -> None: ...

    @abstractmethod
    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` may follow from here, one after another (the state does not change)."""

    @abstractmethod
    def can_end(self) -> bool:
        """Whether the text so far is a whole match (EOS may come next)."""

    @property
    @abstractmethod
    def max_rollback(self) -> int: ...

    @abstractmethod
    def rollback(self, n: int) -> None: ...

    @abstractmethod
    def forced(self) -> Forced:
        """The bytes every continuation starts with; `ends` when after them only EOS may follow."""


def check_rollback(n: int, allowed: int) -> None:
    """Every backend's refusal of a rollback past what it can undo (never an assert: under
    python -O the check, and a rollback written inside one, would vanish)."""
    if not 0 <= n <= allowed:
        raise ValueError(f"cannot roll back {n} tokens: at most {allowed} can be")


class CountedMatcher(Matcher):
    """A matcher over a library that rolls back what it took but does not say how much that is
    (llguidance, xgrammar): the count of tokens advanced and not rolled back is kept here, once."""

    _taken = 0

    def advance(self, token: int) -> None:
        self._advance(token)
        self._taken += 1

    @property
    def max_rollback(self) -> int:
        return self._taken

    def rollback(self, n: int) -> None:
        check_rollback(n, self._taken)
        self._rollback(n)
        self._taken -= n

    @abstractmethod
    def _advance(self, token: int) -> None:
        """Take `token` in the library's matcher (raise if it refuses)."""

    @abstractmethod
    def _rollback(self, n: int) -> None:
        """Undo the library's last `n` tokens, n <= max_rollback."""


class Builder(ABC):
    """The half of a compile that may run in the compiler process: picklable, sent there once."""

    @abstractmethod
    def build(self, key: ConstraintKey) -> Any:
        """A picklable compiled form of `key`; raises GrammarError naming what is wrong."""


class GrammarBackend(ABC):
    name: str
    # whether Builder.build runs in the compiler process (killable, memory-capped) or in a pool
    # thread of the scheduler's process (for a library that is fast and bounds its own work)
    in_process: bool = False

    def __init__(self, builder: Builder) -> None:
        self.builder = builder

    @abstractmethod
    def load(self, key: ConstraintKey, built: Any) -> Any:
        """The compiled grammar, shared by every request on `key`, from what `build` returned."""

    @abstractmethod
    def matcher(self, grammar: Any) -> Matcher:
        """A fresh matcher at the start of `grammar`, able to roll back RETOKENIZE_TOKENS tokens."""

