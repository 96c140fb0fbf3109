"""The expressions a program appends to its state: text, generation, selection, role markers.

`s += expr` executes `expr` against the state right away; `+` chains
expressions (`"Q: " + gen("a")`) into one `Concat` that runs left to right.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    def __add__(self, other: Expr | str) -> Concat:
        return Concat([self, as_expr(other)])

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat([as_expr(other), self])


@dataclass
class Text(Expr):
    value: str


@dataclass
class Concat(Expr):
    parts: list[Expr]

    def __add__(self, other: Expr | str) -> Concat:
        return Concat([*self.parts, as_expr(other)])


@dataclass
class Gen(Expr):
    """Generate into variable `name`; `params` are native sampling params (max_new_tokens, stop,
    regex, ...) and the body's logprob options (return_logprob, logprob_start_len, ...)."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    method: Any  # a ChoicesSamplingMethod (choices.py)


@dataclass
class SeparateReasoning(Expr):
    """Split the variables of the gens and selects in `expr` (just run) into reasoning and answer."""

    names: list[str]
    model_type: str


@dataclass
class VarScopeBegin(Expr):
    name: str


@dataclass
class VarScopeEnd(Expr):
    name: str


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program appends text or frontend_lang expressions, not {type(value).__name__}")


def flatten(expr: Expr) -> list[Expr]:
    """The leaves of `expr` in execution order."""
    if isinstance(expr, Concat):
        return [leaf for part in expr.parts for leaf in flatten(part)]
    return [expr]
