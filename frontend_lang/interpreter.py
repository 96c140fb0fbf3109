"""Running programs: the state `s` a program appends to, forks, runs and batches.

Each `ProgramState` executes its expressions in order on its own thread, so
`s += gen(...)` returns at once and the program only waits where it reads a
result (`s["answer"]`, `s.text()`). Forked states run side by side: a program
that fills three forks sends three requests at the same time, and they share
the prefix the fork sent ahead. A program's error stops its state, not the
others; it surfaces as `ProgramError` carrying the text written so far.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from radixlm.lang.backends.base import LOGPROB_OPTIONS, Backend, Call
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import (
    Concat, Expr, Gen, RoleBegin, RoleEnd, Select, SeparateReasoning, Text, VarScopeBegin, VarScopeEnd, as_expr,
    flatten,
)
from radixlm.lang.reasoning import reasoning_format, separate

_END = object()  # closes a stream of text events

# `dtype` as SGLang's frontend sends it: a regex, and for numbers a space or newline ending the
# literal (a stop, trimmed), so the model ends a number where it would have (the runtime's own
# dtype grammar has no such end and makes the model go on writing digits)
DTYPE_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "int": (r"[-+]?[0-9]+[ \n]*", (" ", "\n")),
    "float": (r"[-+]?[0-9]*\.?[0-9]+[ \n]*", (" ", "\n")),
    "bool": (r"(True|False)", ()),
    "str": (r"\"[\w\d\s]*\"", ()),
}


class ProgramError(RuntimeError):
    """A program failed; `text` is what it had written before the failure."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(f"{message}\n--- program text so far ---\n{text}")
        self.text = text


def _failure(e: BaseException, text: str) -> ProgramError:
    error = ProgramError(f"{type(e).__name__}: {e}", text)
    error.__cause__ = e
    return error


class ProgramState:
    """The `s` of a program: its text, variables, chat messages and the results' meta info.

    NOTE: the expressions appended run on a worker thread that lives only while there is work
    queued: a finished state holds no thread, so a batch of thousands leaves none behind."""

    def __init__(self, backend: Backend, template: ChatTemplate, defaults: dict[str, Any],
                 stream: bool = False, use_thread: bool = True) -> None:
        self.backend = backend
        self.template = template
        self.defaults = defaults  # sampling params that gens without their own value use
        self.stream = stream  # gens stream their text into text_iter as it is generated
        self.use_thread = use_thread  # False: each expression runs in the appending thread
        self._error: ProgramError | None = None
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}
        self._starts: dict[str, int] = {}  # where each variable's text was last written
        self._messages: list[dict[str, str]] = []
        self._role: str | None = None
        self._role_start = 0
        self._fork_start = 0  # the length of the text when this state was forked
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (variable or None, text piece, meta info)
        self._work: deque[Expr] = deque()
        self._idle = threading.Condition()  # guards _work and _worker
        self._worker: threading.Thread | None = None  # set while there is work; only it runs expressions

    # ---- writing -----------------------------------------------------------------------------

    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("a program appended None to its state")
        expr = as_expr(other)
        if not self.use_thread:
            self._run(expr)
            return self
        with self._idle:
            self._work.append(expr)
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="frontend-state", daemon=True)
                self._worker.start()
        return self

    def _role_turn(self, role: str, expr: Expr | str | None) -> Any:
        if expr is None:
            return self._turn(role)
        turn = Concat([RoleBegin(role), as_expr(expr), RoleEnd(role)])
        self += turn
        return turn

    @contextmanager
    def _turn(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr: Expr | str | None = None) -> Any:
        """`s.system(x)` appends a system turn around `x`; `with s.system(): s += ...` opens one."""
        return self._role_turn("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role_turn("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role_turn("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope("x"): s += ...`: the text appended inside becomes variable `x`."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    # ---- reading (each waits for what was appended before) -----------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __contains__(self, name: str) -> bool:
        self.sync(raise_error=False)
        return name in self._vars

    def get_var(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"the program has no variable {name!r}; it has {sorted(self._vars)}")
        return self._vars[name]

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._messages]

    def get_meta_info(self, name: str) -> Any:
        """The meta info of variable `name`'s request (a list of n with n > 1); None, as in
        SGLang, for a name no gen or select wrote."""
        self.sync()
        return self._meta.get(name)

    def error(self) -> ProgramError | None:
        """The program's failure (None if it has not failed), after waiting for what was appended."""
        self.sync(raise_error=False)
        return self._error

    @property
    def success(self) -> bool:
        return self.error() is None

    def sync(self, raise_error: bool = True) -> None:
        """Wait until everything appended so far has run; raise the program's error, if any."""
        with self._idle:
            worker = self._worker
            self._idle.wait_for(lambda: self._worker is None)
        if worker is not None:
            worker.join()  # it ran out of work and is returning: let it be gone
        if raise_error and self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text (or one variable's) piece by piece as it is written; ends with the
        program. A state run without `stream=True` yields it whole, once."""
        for piece, _ in self._pieces(var_name):
            yield piece

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for asyncio code; `return_meta_data=True` yields (piece, meta info) pairs
        for a streamed variable."""
        pieces = self._pieces(var_name)
        while (item := await asyncio.to_thread(next, pieces, _END)) is not _END:
            yield item if return_meta_data and self.stream and var_name is not None else item[0]

    def _pieces(self, var_name: str | None) -> Iterator[tuple[str, Any]]:
        if not self.stream:
            yield (self.text() if var_name is None else self.get_var(var_name)), self.get_meta_info(var_name or "")
            return
        while (event := self._events.get()) is not _END:
            var, piece, meta = event
            if var_name is None or var == var_name:
                yield piece, meta
        self._events.put(_END)  # let another iterator end too
        if self._error is not None:
            raise self._error

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkGroup:
        """`size` copies of this state that continue independently. With more than one, the text
        so far is sent ahead once, prefill only, so that every branch finds it in the prefix cache."""
        if position_ids_offset is not None:
            raise NotImplementedError("fork's position_ids_offset (SGLang's parallel encoding) is not available")
        self.sync()
        if size > 1 and self._text:
            self.backend.cache_prefix(self._text)
        return ForkGroup([self._copy() for _ in range(int(size))], self)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        """`with s.copy() as c: c += ...`: one fork, joined (its new variables gathered) at the end."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    def _copy(self) -> ProgramState:
        other = ProgramState(self.backend, self.template, self.defaults, self.stream, self.use_thread)
        other._text, other._vars, other._meta = self._text, dict(self._vars), dict(self._meta)
        other._starts, other._messages = dict(self._starts), [dict(m) for m in self._messages]
        other._role, other._role_start, other._fork_start = self._role, self._role_start, len(self._text)
        return other

    # ---- execution ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """The worker: run the queued expressions in order; end when the queue is empty."""
        while True:
            with self._idle:
                if not self._work:
                    self._worker = None
                    self._idle.notify_all()
                    return
                expr = self._work.popleft()
            self._run(expr)

    def _run(self, expr: Expr) -> None:
        try:
            if self._error is None:
                for leaf in flatten(expr):
                    self._execute(leaf)
        except Exception as e:  # noqa: BLE001 - any failure ends the program, with its text
            self._error = _failure(e, self._text)

    def _execute(self, leaf: Expr) -> None:
        if isinstance(leaf, Text):
            self._append(leaf.value)
        elif isinstance(leaf, RoleBegin):
            self._begin_turn(leaf.role)
        elif isinstance(leaf, RoleEnd):
            self._end_turn(leaf.role)
        elif isinstance(leaf, Gen):
            self._gen(leaf)
        elif isinstance(leaf, Select):
            self._select(leaf)
        elif isinstance(leaf, SeparateReasoning):
            self._separate_reasoning(leaf)
        elif isinstance(leaf, VarScopeBegin):
            self._starts[leaf.name] = len(self._text)
        elif isinstance(leaf, VarScopeEnd):
            self._vars[leaf.name] = self._text[self._starts[leaf.name]:]
        else:
            raise TypeError(f"cannot execute {leaf!r}")

    def _append(self, text: str, var: str | None = None, meta: Any = None) -> None:
        if var is not None:
            self._starts.setdefault(var, len(self._text))
        self._text += text
        self._events.put((var, text, meta))

    def _store(self, name: str | None, value: Any, meta: Any) -> None:
        if name is not None:
            self._vars[name] = value
            self._meta[name] = meta

    def _begin_turn(self, role: str) -> None:
        t = self.template
        if role not in t.prefix:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(t.prefix)}")
        if self._role is not None:
            raise ValueError(f"{role} turn begins inside the unfinished {self._role} turn")
        if not self._messages and not self._text:
            if role != "system" and t.default_system is not None:  # as the model's own template does
                self._append(t.prefix["system"] + t.default_system + t.suffix["system"])
                self._messages.append({"role": "system", "content": t.default_system})
        self._append(t.prefix[role])
        self._role, self._role_start = role, len(self._text)

    def _end_turn(self, role: str) -> None:
        if self._role != role:
            raise ValueError(f"{role} turn ends, but the open turn is {self._role or 'none'}")
        self._messages.append({"role": role, "content": self._text[self._role_start:]})
        self._append(self.template.suffix[role])
        self._role = None

    def _call(self, params: dict[str, Any], options: dict[str, Any] | None = None) -> Call:
        turn = None if self._role is None else (self._role, self._text[self._role_start:])
        return Call(self._text, params, [dict(m) for m in self._messages], turn, options or {})

    def _gen(self, leaf: Gen) -> None:
        params = {**self.defaults, **leaf.params}
        options = {k: params.pop(k) for k in LOGPROB_OPTIONS if k in params}
        stops = list(self.template.stop) if self._role == "assistant" else []
        if "dtype" in params:
            if {"regex", "json_schema", "ebnf"} & set(params):
                raise ValueError("a gen takes one of dtype, regex, json_schema and ebnf")
            params["regex"], dtype_stops = DTYPE_RULES[params.pop("dtype")]
            stops += dtype_stops
        if stops:
            params["stop"] = list(params.get("stop") or []) + [s for s in stops if s not in (params.get("stop") or [])]
        call = self._call(params, options)
        self._starts.pop(leaf.name, None)
        if params.get("n", 1) > 1:
            if self.stream:
                raise ValueError("a gen with n > 1 cannot stream: run the program without stream=True")
            result = self.backend.generate(call)
            results = result if isinstance(result, list) else [result]
            self._append(results[0]["text"], leaf.name)  # the first sample continues the program
            self._store(leaf.name, [r["text"] for r in results], [r["meta_info"] for r in results])
            return
        if not self.stream:
            result = self.backend.generate(call)
            self._append(result["text"], leaf.name, result["meta_info"])
            self._store(leaf.name, result["text"], result["meta_info"])
            return
        text, meta = "", {}
        for chunk in self.backend.stream(call):
            meta = chunk.get("meta_info", meta)
            self._append(chunk["text"], leaf.name, meta)
            text += chunk["text"]
        self._store(leaf.name, text, meta)

    def _select(self, leaf: Select) -> None:
        method = leaf.method
        unconditional = bool(getattr(method, "requires_unconditional_logprobs", False))
        scored = self.backend.choice_logprobs(self._call({}), leaf.choices, unconditional)
        normalized = [_mean_logprob(tokens) for tokens in scored.conditional]
        decision = method(choices=leaf.choices, normalized_prompt_logprobs=normalized,
                          input_token_logprobs=scored.conditional,
                          output_token_logprobs=[[] for _ in leaf.choices],
                          unconditional_token_logprobs=scored.unconditional)
        meta = dict(decision.meta_info or {})
        # ours beside SGLang's keys: the index, and the score each choice was ranked by
        meta.update(scored.meta_info, choices=leaf.choices, selected_index=leaf.choices.index(decision.decision),
                    normalized_scores=meta.get("normalized_unconditional_prompt_logprobs", normalized))
        self._starts.pop(leaf.name, None)
        self._append(decision.decision, leaf.name, meta)
        self._store(leaf.name, decision.decision, meta)

    def _separate_reasoning(self, leaf: SeparateReasoning) -> None:
        """Each variable becomes its answer, `{name}_reasoning_content` its thinking, and the
        program's text keeps the answer only. Not while streaming (the text is out already), as SGLang."""
        if self.stream:
            return
        fmt = reasoning_format(leaf.model_type)
        for name in sorted(leaf.names, key=lambda n: self._starts[n], reverse=True):  # later spans first
            value, start = self._vars[name], self._starts[name]
            pieces = [separate(v, fmt) for v in (value if isinstance(value, list) else [value])]
            written = value[0] if isinstance(value, list) else value  # what the text holds
            self._text = self._text[:start] + pieces[0].content + self._text[start + len(written):]
            if isinstance(value, list):
                self._vars[name] = [p.content for p in pieces]
                self._vars[f"{name}_reasoning_content"] = [p.reasoning for p in pieces]
            else:
                self._vars[name], self._vars[f"{name}_reasoning_content"] = pieces[0].content, pieces[0].reasoning


def _mean_logprob(tokens: list[list[Any]]) -> float:
    values = [t[0] for t in tokens if t[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


class ForkGroup(list):
    """The states `fork` made. `forks += expr` appends `expr` to every branch (they run in
    parallel); `forks += lambda i: ...` appends what the function gives for branch i; a list
    appends its items, one per branch."""

    def __init__(self, states: list[ProgramState], parent: ProgramState | None = None) -> None:
        super().__init__(states)
        self.parent = parent

    @property
    def states(self) -> list[ProgramState]:
        return list(self)

    def __iadd__(self, other: Any) -> ForkGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self):
                raise ValueError(f"{len(other)} expressions for {len(self)} branches")
            parts = list(other)
        elif callable(other) and not isinstance(other, Expr):
            parts = [other(i) for i in range(len(self))]
        else:
            parts = [other] * len(self)
        for state, part in zip(self, parts):
            state += part
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch (raise the first branch error), then, as SGLang:
        `gather_variable` gives the parent each variable the branches made, as a list with one
        value per branch; `concate_and_append` appends to the parent the text each branch wrote."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode is gather_variable or concate_and_append, not {mode!r}")
        for state in self:
            state.sync()
        parent = self.parent
        if parent is not None and mode == "gather_variable":
            parent.sync()
            had = set(parent._vars)
            for state in self:
                for name in state._vars.keys() - had:
                    parent._vars.setdefault(name, []).append(state._vars[name])
        elif parent is not None:
            parent += "".join(state._text[state._fork_start:] for state in self)
        for state in self:
            state._events.put(_END)  # a streamed branch's text_iter ends here


class TraceStop(Exception):
    """Tracing reached the first request (or a read of a result): the constant prefix ends here."""


class _TracingState(ProgramState):
    """Runs a program's text-only head in the calling thread, never calling the backend."""

    def __iadd__(self, other: Expr | str) -> ProgramState:
        for leaf in flatten(as_expr(other)):
            if isinstance(leaf, (Gen, Select)):
                raise TraceStop
            self._execute(leaf)
        return self

    def sync(self, raise_error: bool = True) -> None:
        raise TraceStop

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkGroup:
        raise TraceStop


def constant_prefix(fn: Callable[..., Any], backend: Backend, arg_names: list[str], positional: int) -> str:
    """The text every run of `fn` writes before its first request, whatever its arguments:
    the common head of two traces with different stand-in arguments ("" when tracing fails)."""
    traces = []
    for variant in "\ue000\ue001":  # private-use characters: the two traces differ at the first one
        state = _TracingState(backend, backend.chat_template, {})
        args = [f"{variant}arg{i}" for i in range(positional)]
        kwargs = {name: f"{variant}{name}" for name in arg_names}
        try:
            fn(state, *args, **kwargs)
        except TraceStop:
            pass
        except Exception:  # noqa: BLE001 - arguments used as non-strings: no prefix to share
            return ""
        traces.append(state._text)
    head = 0
    for x, y in zip(*traces):
        if x != y:
            break
        head += 1
    return traces[0][:head]


def run_program(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], backend: Backend,
                defaults: dict[str, Any], stream: bool = False, use_thread: bool = True,
                verbosity: int = 0) -> ProgramState:
    state = ProgramState(backend, backend.chat_template, defaults, stream, use_thread)

    def body() -> None:
        try:
            fn(state, *args, **kwargs)
            state.sync(raise_error=False)
        except Exception as e:  # noqa: BLE001 - the program's own code failed
            state.sync(raise_error=False)
            if state._error is None:
                state._error = _failure(e, state._text)
        finally:
            state._events.put(_END)
            if verbosity >= 2:
                print(state._text)

    if stream:
        threading.Thread(target=body, name="frontend-program", daemon=True).start()
        return state
    body()
    if state._error is not None:
        raise state._error
    return state


def run_batch(fn: Callable[..., Any], rows: list[dict[str, Any]], backend: Backend, defaults: dict[str, Any],
              num_threads: int | str = "auto", progress_bar: bool = False,
              verbosity: int = 0) -> Iterator[ProgramState]:
    """Run `fn` once per row of arguments, in parallel, yielding the states in order; a failed
    program's state has its `error()`. The threads are gone when the last state is yielded."""
    if not rows:
        return
    threads = min(64, len(rows)) if num_threads == "auto" else max(1, int(num_threads))

    def one(kwargs: dict[str, Any]) -> ProgramState:
        try:
            return run_program(fn, (), kwargs, backend, defaults, verbosity=verbosity)
        except ProgramError as e:
            state = ProgramState(backend, backend.chat_template, defaults)
            state._text, state._error = e.text, e
            return state

    with ThreadPoolExecutor(threads, thread_name_prefix="frontend-batch") as pool:
        results = pool.map(one, rows)
        if progress_bar:
            from tqdm import tqdm

            results = tqdm(results, total=len(rows))
        yield from results
