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
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from radixlm.lang.backends.base import Backend, Call
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import Expr, Gen, RoleBegin, RoleEnd, Select, Text, as_expr, flatten

_END = object()  # closes a stream of text events


class ProgramError(RuntimeError):
    """A program failed; `text` is what it had written before the failure."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(f"{message}\n--- program text so far ---\n{text}")
        self.text = text


class ProgramState:
    """The `s` of a program: its text, variables, chat messages and the results' meta info."""

    def __init__(self, backend: Backend, template: ChatTemplate, defaults: dict[str, Any],
                 stream: bool = False) -> None:
        self.backend = backend
        self.template = template
        self.defaults = defaults  # sampling params that gens without their own value use
        self.stream = stream  # gens stream their text into text_iter as it is generated
        self.error: ProgramError | None = None
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, str]] = []
        self._role: str | None = None
        self._role_start = 0
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (variable or None, text piece)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None

    # ---- writing -----------------------------------------------------------------------------

    def __iadd__(self, other: Expr | str) -> ProgramState:
        expr = as_expr(other)
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._execute_forever, name="frontend-state", daemon=True)
            self._thread.start()
        self._work.put(expr)
        return self

    @contextmanager
    def _turn(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self) -> Any:
        """`with s.system(): s += ...` — the same as `s += system(...)`."""
        return self._turn("system")

    def user(self) -> Any:
        return self._turn("user")

    def assistant(self) -> Any:
        return self._turn("assistant")

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    # ---- reading (each waits for what was appended before) -----------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

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

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.sync()
        return self._meta[name]

    @property
    def success(self) -> bool:
        self.sync(raise_error=False)
        return self.error is None

    def sync(self, raise_error: bool = True) -> None:
        """Wait until everything appended so far has run; raise the program's error, if any."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        if raise_error and self.error is not None:
            raise self.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text (or one variable's) piece by piece as it is written; ends with the program."""
        while (event := self._events.get()) is not _END:
            var, piece = event
            if var_name is None or var == var_name:
                yield piece
        self._events.put(_END)  # let another iterator end too
        if self.error is not None:
            raise self.error

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        pieces = self.text_iter(var_name)
        while (piece := await asyncio.to_thread(next, pieces, _END)) is not _END:
            yield piece

    def fork(self, size: int = 1) -> ForkGroup:
        """`size` copies of this state that continue independently. The text so far is sent
        ahead once, prefill only, so that every branch finds it in the prefix cache."""
        self.sync()
        if self._text:
            self.backend.cache_prefix(self._text)
        return ForkGroup([self._copy() for _ in range(size)])

    def _copy(self) -> ProgramState:
        other = ProgramState(self.backend, self.template, self.defaults)
        other._text, other._vars, other._meta = self._text, dict(self._vars), dict(self._meta)
        other._messages = [dict(m) for m in self._messages]
        other._role, other._role_start = self._role, self._role_start
        return other

    # ---- execution ---------------------------------------------------------------------------

    def _execute_forever(self) -> None:
        while True:
            expr = self._work.get()
            try:
                if self.error is None:
                    for leaf in flatten(expr):
                        self._execute(leaf)
            except Exception as e:  # noqa: BLE001 - any failure ends the program, with its text
                self.error = ProgramError(f"{type(e).__name__}: {e}", self._text)
                self.error.__cause__ = e
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

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
            result = self.backend.select(self._call({}), leaf.choices, leaf.method)
            self._store(leaf.name, result["text"], result["meta_info"])
            self._append(result["text"], leaf.name)
        else:
            raise TypeError(f"cannot execute {leaf!r}")

    def _append(self, text: str, var: str | None = None) -> None:
        self._text += text
        self._events.put((var, text))

    def _store(self, name: str | None, value: str, meta: dict[str, Any]) -> None:
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
            self._append(t.begin)
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

    def _call(self, params: dict[str, Any], return_logprob: bool = False, top_logprobs_num: int = 0) -> Call:
        turn = None if self._role is None else (self._role, self._text[self._role_start:])
        return Call(self._text, params, [dict(m) for m in self._messages], turn, return_logprob, top_logprobs_num)

    def _gen(self, leaf: Gen) -> None:
        params = {**self.defaults, **leaf.params}
        if self._role == "assistant" and self.template.stop:
            params["stop"] = list(params.get("stop") or []) + [s for s in self.template.stop
                                                                if s not in (params.get("stop") or [])]
        call = self._call(params, leaf.return_logprob, leaf.top_logprobs_num)
        if not self.stream:
            result = self.backend.generate(call)
            self._append(result["text"], leaf.name)
            self._store(leaf.name, result["text"], result["meta_info"])
            return
        text, meta = "", {}
        for chunk in self.backend.stream(call):
            self._append(chunk["text"], leaf.name)
            text += chunk["text"]
            meta = chunk["meta_info"]
        self._store(leaf.name, text, meta)


class ForkGroup(list):
    """The states `fork` made. `forks += expr` appends `expr` to every branch (they run in parallel)."""

    def __iadd__(self, other: Expr | str) -> ForkGroup:
        for state in self:
            state += other
        return self

    def join(self) -> None:
        """Wait for every branch; raise the first branch error."""
        for state in self:
            state.sync()


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

    def fork(self, size: int = 1) -> ForkGroup:
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
                defaults: dict[str, Any], stream: bool = False) -> ProgramState:
    state = ProgramState(backend, backend.chat_template, defaults, stream)

    def body() -> None:
        try:
            fn(state, *args, **kwargs)
            state.sync(raise_error=False)
        except Exception as e:  # noqa: BLE001 - the program's own code failed
            state.sync(raise_error=False)
            if state.error is None:
                state.error = ProgramError(f"{type(e).__name__}: {e}", state._text)
                state.error.__cause__ = e
        finally:
            state._events.put(_END)

    if stream:
        threading.Thread(target=body, name="frontend-program", daemon=True).start()
        return state
    body()
    if state.error is not None:
        raise state.error
    return state


def run_batch(fn: Callable[..., Any], batch_kwargs: list[dict[str, Any]], backend: Backend,
              defaults: dict[str, Any], num_threads: int | str = "auto",
              progress_bar: bool = False) -> list[ProgramState]:
    """Run `fn` once per kwargs dict, in parallel; a failed program's state has `error` set."""
    if not batch_kwargs:
        return []
    if len(batch_kwargs) > 1:
        prefix = constant_prefix(fn, backend, list(batch_kwargs[0]), 0)
        if prefix:
            backend.cache_prefix(prefix)
    threads = min(64, len(batch_kwargs)) if num_threads == "auto" else max(1, int(num_threads))

    def one(kwargs: dict[str, Any]) -> ProgramState:
        try:
            return run_program(fn, (), kwargs, backend, defaults)
        except ProgramError as e:
            state = ProgramState(backend, backend.chat_template, defaults)
            state._text, state.error = e.text, e
            return state

    with ThreadPoolExecutor(threads, thread_name_prefix="frontend-batch") as pool:
        results = pool.map(one, batch_kwargs)
        if progress_bar:
            from tqdm import tqdm

            results = tqdm(results, total=len(batch_kwargs))
        return list(results)
