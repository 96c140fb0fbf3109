"""The primitives a program is written with: `gen`, `select`, roles, and the backend setting.

Names, arguments and their positional order are SGLang's (`import radixlm as sgl`
runs an SGLang program); ours come after them, keyword-only. A `gen` argument
left as None is not sent, so the defaults given to `run` apply, then the
runtime's.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from radixlm.lang.backends.base import LOGPROB_OPTIONS, Backend
from radixlm.lang.choices import as_method, token_length_normalized
from radixlm.lang.interpreter import ProgramState, constant_prefix, run_batch, run_program
from radixlm.lang.ir import Expr, Gen, RoleBegin, RoleEnd, Select, SeparateReasoning, as_expr, flatten
from radixlm.lang.reasoning import reasoning_format

_DTYPES = {int: "int", float: "float", bool: "bool", str: "str"}
# gen argument -> native sampling param
_RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# gen arguments sent as they are: SGLang's, then ours (native sampling params SGLang's gen lacks)
_SENT = ("max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
         "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", *LOGPROB_OPTIONS, "regex",
         "repetition_penalty", "seed", "sampling_seed", "no_stop_trim", "ebnf", "logit_bias", "custom_params",
         "skip_special_tokens", "spaces_between_special_tokens")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: Any = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    *,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    sampling_seed: int | None = None,
    no_stop_trim: bool | None = None,
    ebnf: str | None = None,
    logit_bias: dict[int, float] | None = None,
    custom_params: dict[str, Any] | None = None,
    skip_special_tokens: bool | None = None,
    spaces_between_special_tokens: bool | None = None,
) -> Expr:
    """Generate text into variable `name` (with n > 1: a list of n texts; the first goes on).
    With `choices` it is a `select`."""
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      token_length_normalized if choices_method is None else choices_method)
    args = dict(locals())
    params = {_RENAMED.get(key, key): args[key] for key in _SENT if args[key] is not None}
    if isinstance(stop, str):
        params["stop"] = [stop]
    if json_schema is not None:
        params["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if dtype is not None:
        if _DTYPES.get(dtype, dtype) not in _DTYPES.values():
            raise ValueError(f"dtype is int, float, bool or str, not {dtype!r}")
        params["dtype"] = _DTYPES.get(dtype, dtype)
    return Gen(name, params)


# gen_int's and gen_string's positional arguments after the name, in SGLang's order
_TYPED_ORDER = ("max_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
                "top_logprobs_num", "return_text_in_logprobs")


def _typed_gen(name: str | None, dtype: type, args: tuple, kwargs: dict[str, Any]) -> Expr:
    if len(args) > len(_TYPED_ORDER):
        raise TypeError(f"gen_{dtype.__name__} takes at most {len(_TYPED_ORDER) + 1} positional arguments")
    clash = {"dtype", "regex", "json_schema", "choices", "ebnf"} & set(kwargs)
    if clash:
        raise TypeError(f"gen_{dtype.__name__} fixes the output's form; it takes no {', '.join(sorted(clash))}")
    for key, value in zip(_TYPED_ORDER, args):
        if key in kwargs:
            raise TypeError(f"gen_{dtype.__name__} got {key} both by position and by name")
        kwargs[key] = value
    return gen(name, dtype=dtype, **kwargs)


def gen_int(name: str | None = None, *args: Any, **kwargs: Any) -> Expr:
    """`gen` of an integer; positional arguments: max_tokens, n, stop, stop_token_ids, stop_regex,
    temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos,
    return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs (SGLang's order)."""
    return _typed_gen(name, int, args, kwargs)


def gen_string(name: str | None = None, *args: Any, **kwargs: Any) -> Expr:
    """`gen` of a string literal; positional arguments as `gen_int`'s."""
    return _typed_gen(name, str, args, kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: Any = token_length_normalized) -> Expr:
    """Pick one of `choices` by the model's likelihood (scored in one shared prefill). The
    methods: token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized,
    or an object with their call interface."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings")
    if not isinstance(temperature, (int, float)) or temperature > 1e-5:
        raise ValueError(f"select scores choices by likelihood: temperature must be 0, not {temperature!r} "
                         "(the fourth argument is choices_method)")
    return Select(name, list(choices), as_method(choices_method))


def separate_reasoning(expr: Expr | None = None, model_type: str | None = None) -> Expr:
    """`expr`, then its gens' and selects' text split into the answer (the variable) and
    `{name}_reasoning_content` (the thinking), the way `model_type` (deepseek-r1, qwen3, ...) writes it."""
    reasoning_format(model_type)  # an unknown model type fails here
    if expr is None:
        return as_expr("")
    names = [leaf.name for leaf in flatten(as_expr(expr)) if isinstance(leaf, (Gen, Select))]
    if not all(names):
        raise ValueError("separate_reasoning needs named gens and selects "
                         "(the reasoning goes in {name}_reasoning_content)")
    return as_expr(expr) + SeparateReasoning(names, model_type)


def image(expr: Any) -> Expr:
    raise NotImplementedError("image: radixlm serves text-only models (no vision encoder), so programs cannot "
                              "send images")


def video(path: str, num_frames: int) -> Expr:
    raise NotImplementedError("video: radixlm serves text-only models (no vision encoder), so programs cannot "
                              "send video")


def _role(role: str, expr: Expr | str | None) -> Expr:
    # as SGLang's: without an expression, an empty turn (use the *_begin/*_end pairs to open one)
    return RoleBegin(role) + as_expr("" if expr is None else expr) + RoleEnd(role)


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

@dataclass
class GlobalConfig:
    """SGLang's `global_config`: the settings that mean something here."""

    default_backend: Backend | None = None
    verbosity: int = 0  # 2: print each program's text when it finishes
    enable_precache_with_tracing: bool = True  # run_batch prefills the program's constant prefix first


global_config = GlobalConfig()

# `run` keyword arguments that are sampling defaults for the program's gens, not program arguments
SAMPLING_DEFAULTS = {"max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
                     "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                     "ignore_eos", "seed", "sampling_seed", "no_stop_trim", *LOGPROB_OPTIONS}


def set_default_backend(backend: Backend) -> None:
    global_config.default_backend = backend


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def flush_cache(backend: Backend | None = None) -> bool:
    """Empty the runtime's prefix cache; False when there is no backend or the runtime refused
    (requests are running)."""
    backend = backend or global_config.default_backend
    return False if backend is None else backend.flush_cache()


def get_server_info(backend: Backend | None = None) -> dict[str, Any] | None:
    """The server's options and state (`/get_server_info`); None when there is no backend."""
    backend = backend or global_config.default_backend
    return None if backend is None else backend.get_server_info()


class Function:
    """A program: a Python function whose first argument is the state `s`."""

    def __init__(self, fn: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.fn = fn
        # SGLang's speculative execution for chat-only APIs: accepted, and not needed here (every
        # gen is its own request, and the prefix cache makes the repeated prompt cheap)
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        spec = inspect.getfullargspec(fn)
        self.arg_names = spec.args[1:]
        self.arg_defaults = spec.defaults or ()
        functools.update_wrapper(self, fn)

    def bind(self, **kwargs: Any) -> Function:
        """The program with some arguments fixed (they win over the same arguments given to run)."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.fn.__name__} has no arguments {unknown}; it has {self.arg_names}")
        return Function(self.fn, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False, use_thread: bool = True,
            **kwargs: Any) -> ProgramState:
        """Run once. Keyword arguments named like sampling params (temperature, max_new_tokens,
        return_logprob, ...) are defaults for every gen; the rest go to the function. With
        `stream=True` the state returns at once: read it with `text_iter()` while the program
        runs. `use_thread=False` runs each expression as it is appended, in the caller's thread."""
        defaults, program_kwargs = _split(kwargs, self.arg_names)
        return run_program(self.fn, args, {**program_kwargs, **self.bind_arguments}, _backend(backend), defaults,
                           stream, use_thread, global_config.verbosity)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[list[Any] | tuple], *,
                  backend: Backend | None = None, num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False, **defaults: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per row, in parallel; check each state's `success` / `error()`. A row is a
        dict of arguments or a list of them in the function's order. `generator_style=True`
        yields the states in order as they finish."""
        sampling, unknown = _split(defaults, [])
        if unknown:
            raise TypeError(f"run_batch got unexpected arguments {sorted(unknown)}; program arguments go in batch_kwargs")
        rows = [{**row, **self.bind_arguments} for row in self._rows(batch_kwargs)]
        backend = _backend(backend)
        if global_config.enable_precache_with_tracing and len(rows) > 1:
            self.cache(backend, list(rows[0]))
        states = run_batch(self.fn, rows, backend, sampling, num_threads, progress_bar, global_config.verbosity)
        return states if generator_style else list(states)

    def cache(self, backend: Backend | None = None, arg_names: list[str] | None = None) -> None:
        """Prefill the text every run writes before its first request (a shared instruction or
        few-shot block), so that runs find it in the prefix cache."""
        backend = _backend(backend)
        prefix = constant_prefix(self.fn, backend, self.arg_names if arg_names is None else arg_names, 0)
        if prefix:
            backend.cache_prefix(prefix)

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> Any:
        raise NotImplementedError("trace: radixlm runs programs as they append (no expression graph to trace); "
                                  "Function.cache() prefills a program's constant prefix")

    def _rows(self, batch: list[dict[str, Any]] | list[list[Any] | tuple]) -> list[dict[str, Any]]:
        if not isinstance(batch, (list, tuple)):
            raise TypeError("run_batch takes a list of rows (dicts of arguments, or lists in the function's order)")
        rows = []
        required = len(self.arg_names) - len(self.arg_defaults)
        for row in batch:
            if isinstance(row, dict):
                rows.append(row)
            elif isinstance(row, (list, tuple)) and required <= len(row) <= len(self.arg_names):
                rows.append(dict(zip(self.arg_names, row)))
            else:
                raise TypeError(f"a run_batch row must be a dict or a list of {required} to {len(self.arg_names)} "
                                f"arguments for {self.arg_names}, not {row!r}")
        return rows

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """On a program state (from inside another program): run on it. Otherwise, as SGLang: `run`."""
        if args and isinstance(args[0], ProgramState):
            return self.fn(*args, **kwargs)
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator, bare or with arguments: turn `def prog(s, ...)` into a program with `run` and `run_batch`."""
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda fn: Function(fn, num_api_spec_tokens)


def _split(kwargs: dict[str, Any], arg_names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sampling defaults, program arguments): a name the function declares is its argument."""
    sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_DEFAULTS and k not in arg_names}
    defaults = {k: v for k, v in sampling.items() if v is not None}
    if isinstance(defaults.get("stop"), str):
        defaults["stop"] = [defaults["stop"]]
    return defaults, {k: v for k, v in kwargs.items() if k not in sampling}


def _backend(backend: Backend | None) -> Backend:
    backend = backend or global_config.default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))")
    return backend
