"""The primitives a program is written with: `gen`, `select`, roles, and the backend setting.

Names and arguments follow SGLang's frontend language. A `gen` argument left
as None is not sent, so the defaults given to `run` apply, then the runtime's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from radixlm.lang.backends.base import Backend
from radixlm.lang.interpreter import ProgramState, run_batch, run_program
from radixlm.lang.ir import Expr, Gen, RoleBegin, RoleEnd, Select, as_expr

token_length_normalized = "token_length_normalized"
greedy_token = "greedy_token"
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"

_DTYPES = {int: "int", float: "float", bool: "bool", str: "str"}
# gen argument -> native sampling param
_RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: str = token_length_normalized,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> Expr:
    """Generate text into variable `name` (or `choices`: select one of them)."""
    if choices is not None:
        return select(name, choices, choices_method)
    args = dict(locals())
    params = {}
    for key in ("max_tokens", "min_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "regex"):
        if args[key] is not None:
            params[_RENAMED.get(key, key)] = args[key]
    if isinstance(stop, str):
        params["stop"] = [stop]
    if json_schema is not None:
        params["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if dtype is not None:
        params["dtype"] = _DTYPES.get(dtype, dtype)
    return Gen(name, params, return_logprob, top_logprobs_num)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None,
           choices_method: str = token_length_normalized) -> Expr:
    """Pick one of `choices` by the model's likelihood (scored in one shared prefill)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings")
    return Select(name, list(choices), choices_method)


def _role(role: str, expr: Expr | str | None) -> Expr:
    if expr is None:
        return RoleBegin(role)
    return RoleBegin(role) + as_expr(expr) + RoleEnd(role)


def system(expr: Expr | str | None = None) -> Expr:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


# ---- programs and backends ---------------------------------------------------------------

_default_backend: Backend | None = None

# `run` keyword arguments that are sampling defaults for the program's gens, not program arguments
SAMPLING_DEFAULTS = {"max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                     "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed"}


def set_default_backend(backend: Backend) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Function:
    """A program: a Python function whose first argument is the state `s`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run once. Keyword arguments named like sampling params (temperature, max_new_tokens,
        ...) are defaults for every gen; the rest go to the function. With `stream=True` the
        state returns at once: read it with `text_iter()` while the program runs."""
        defaults, program_kwargs = _split(kwargs)
        return run_program(self.fn, args, program_kwargs, _backend(backend), defaults, stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, **defaults: Any) -> list[ProgramState]:
        """Run once per kwargs dict, in parallel; check each state's `success` / `error`."""
        sampling, unknown = _split(defaults)
        if unknown:
            raise TypeError(f"run_batch got unexpected arguments {sorted(unknown)}; program arguments go in batch_kwargs")
        return run_batch(self.fn, batch_kwargs, _backend(backend), sampling, num_threads, progress_bar)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Call from inside another program, on its state."""
        if not isinstance(s, ProgramState):
            raise TypeError(f"{self.fn.__name__} is a program: use {self.fn.__name__}.run(...), "
                            "or call it on a program state")
        return self.fn(s, *args, **kwargs)


def function(fn: Callable[..., Any]) -> Function:
    """Decorator: turn `def prog(s, ...)` into a program with `run` and `run_batch`."""
    return Function(fn)


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    defaults = {k: v for k, v in kwargs.items() if k in SAMPLING_DEFAULTS}
    if isinstance(defaults.get("stop"), str):
        defaults["stop"] = [defaults["stop"]]
    return defaults, {k: v for k, v in kwargs.items() if k not in SAMPLING_DEFAULTS}


def _backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))")
    return backend
