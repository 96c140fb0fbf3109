"""Constraints compiled off the scheduler's critical path by the `--grammar-backend` (the contract in
backend.py, made by `make_backend`), and the per-step token bitmask of a batch (its layout:
token_mask.py).

A request with a constraint waits in the scheduler's pending list while it compiles (in a
compiler process, or in a pool thread for a backend that compiles in-process; cached by
constraint, LRU); it then carries its own `Matcher` (its place in the constraint), advanced by
every token it samples. Each step the constrained rows of the batch get one bitmask row each;
unconstrained rows stay all-ones.
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
import time
import weakref
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from radixlm.runtime.args import GRAMMAR_BACKENDS, ServerArgs
from radixlm.runtime.constrained import compile_worker
from radixlm.runtime.constrained.backend import ConstraintKey, GrammarBackend, GrammarError, Matcher
from radixlm.runtime.constrained.jump_forward import JumpForward
from radixlm.runtime.token_mask import allocate_mask

Grammar = Any  # a backend's compiled constraint (GrammarBackend.load)
START_TIMEOUT_S = 120.0  # a compiler process's start, before its first constraint


class GrammarCompiler:
    """Compiles constraints with `backend` off the caller's thread; `poll` answers without waiting.

    Each of `workers` threads drives one child process (compile_worker.py) that holds the
    backend's Builder and builds; a build that runs past `timeout_s` kills its child (the
    next build starts a fresh one), so an exploding automaton costs one request, not a core.
    A backend that compiles in-process (`GrammarBackend.in_process`) builds in the thread itself,
    with no time limit: such a backend bounds its own work.

    Every outcome, a failure too, is kept by key and answered to every request that asks for
    that key (successes LRU, failures for `failure_ttl_s`): a compile runs once however many
    requests wait on it, and a bad constraint sent a thousand times costs one compile.
    `ready_fd` turns readable when a compile ends, so a waiting caller can sleep in select.
    """

    def __init__(self, backend: GrammarBackend, workers: int = 2, cache_size: int = 256,
                 timeout_s: float = 30.0, jump_forward: JumpForward | None = None,
                 failure_ttl_s: float = 60.0) -> None:
        self.backend = backend
        self.jump_forward = jump_forward
        self.timeout_s = timeout_s
        self.failure_ttl_s = failure_ttl_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="radixlm-grammar")
        self._local = threading.local()  # each pool thread's child process
        self._children: list[subprocess.Popen] = []
        self._children_lock = threading.Lock()
        self._wakeup = _Wakeup()
        # the children go when the compiler does, even when no one calls shutdown
        self.shutdown = weakref.finalize(self, _stop, self._pool, self._children, self._wakeup)
        # NOTE: the pool threads finish compiles while the caller submits and polls: _lock guards
        # what follows. Reentrant: a future that is already done runs its callback at once.
        self._lock = threading.RLock()
        self._results: OrderedDict[ConstraintKey, Grammar | GrammarError] = OrderedDict()
        self._failed_at: dict[ConstraintKey, float] = {}  # when each failure in _results was found
        self._cache_size = cache_size
        self._compiling: dict[ConstraintKey, Future] = {}
        self._waiters: Counter[ConstraintKey] = Counter()

    @property
    def ready_fd(self) -> int:
        """A descriptor that is readable once some compile has ended since the last `drain_ready`."""
        return self._wakeup.read_fd

    def drain_ready(self) -> None:
        self._wakeup.drain()

    def submit(self, key: ConstraintKey) -> None:
        """One more request waits on `key`; its compile starts unless its outcome is known or coming."""
        with self._lock:
            self._waiters[key] += 1
            self._start(key)

    def forget(self, key: ConstraintKey) -> None:
        """A request that waited on `key` is gone; a compile no one waits on any more and that has
        not started yet is dropped."""
        with self._lock:
            self._waiters[key] -= 1
            if self._waiters[key] > 0:
                return
            del self._waiters[key]
            future = self._compiling.get(key)
            if future is not None and future.cancel():
                del self._compiling[key]

    def _start(self, key: ConstraintKey) -> None:
        if key in self._failed_at and time.monotonic() - self._failed_at[key] > self.failure_ttl_s:
            del self._results[key], self._failed_at[key]  # a failure is retried after a while
        if key in self._results or key in self._compiling:
            return
        future = self._pool.submit(self._compile, key)
        self._compiling[key] = future
        future.add_done_callback(lambda f: self._finished(key, f))

    def _finished(self, key: ConstraintKey, future: Future) -> None:
        """The pool thread's last word on a compile: its outcome is kept for every waiter."""
        if future.cancelled():
            return
        error = future.exception()
        with self._lock:
            if self._compiling.get(key) is not future:
                return
            del self._compiling[key]
            if error is None:
                self._results[key] = future.result()
            else:
                self._results[key] = error if isinstance(error, GrammarError) else GrammarError(
                    f"compiling the {key[0]} constraint failed: {error}")
                self._failed_at[key] = time.monotonic()
            while len(self._results) > self._cache_size:
                old, _ = self._results.popitem(last=False)
                self._failed_at.pop(old, None)
        self._wakeup.notify()

    def _compile(self, key: ConstraintKey) -> Grammar:
        built = self.backend.builder.build(key) if self.backend.in_process else self._build_in_child(key)
        return self.backend.load(key, built)

    def _build_in_child(self, key: ConstraintKey) -> object:
        child = self._child()
        try:
            compile_worker.write_message(child.stdin, key)
            if not select.select([child.stdout], [], [], self.timeout_s)[0]:
                _kill(child)
                raise GrammarError(f"compiling the {key[0]} constraint took more than {self.timeout_s:g}s")
            status, value = compile_worker.read_message(child.stdout)
        except (EOFError, OSError):
            _kill(child)
            raise GrammarError(f"the compiler process died on the {key[0]} constraint (out of memory?)") from None
        if status != "ok":
            raise GrammarError(value)
        return value

    def _child(self) -> subprocess.Popen:
        """This thread's compiler process, started (and sent the Builder) when there is none."""
        child = getattr(self._local, "child", None)
        if child is None or child.poll() is not None:
            child = self._local.child = compile_worker.spawn()
            with self._children_lock:  # the exited ones go, so the list stays as long as the pool
                self._children[:] = [c for c in self._children if c.poll() is None] + [child]
            try:
                compile_worker.write_message(child.stdin, self.backend.builder)
                # its start (imports, the vocabulary) has its own, longer limit: a loaded machine
                # must not fail the first constraint for it
                if not select.select([child.stdout], [], [], max(START_TIMEOUT_S, self.timeout_s))[0]:
                    raise EOFError
                compile_worker.read_message(child.stdout)
            except (EOFError, OSError):
                _kill(child)
                raise GrammarError("the constraint compiler process did not start") from None
        return child

    def poll(self, key: ConstraintKey) -> Grammar | GrammarError | None:
        """The Grammar when ready, the error if compiling failed or timed out, else None.
        The same answer goes to every request that polls `key`."""
        with self._lock:
            result = self._results.get(key)
            if result is not None:
                self._results.move_to_end(key)
                return result
            self._start(key)  # (its outcome was evicted before this waiter saw it: compile again)
            return None

    def matcher(self, grammar: Grammar) -> Matcher:
        """A fresh matcher for a request on a compiled `grammar` (what `poll` answered)."""
        return self.backend.matcher(grammar)

    @property
    def num_compiling(self) -> int:
        with self._lock:
            return len(self._compiling)


class _Wakeup:
    """A self-pipe: `notify` from any thread makes `read_fd` readable until `drain`."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def notify(self) -> None:
        with self._lock:  # NOTE: never write to a closed descriptor: its number may be another file's now
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:  # full: the reader has plenty to wake on
                pass

    def drain(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                while os.read(self.read_fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.read_fd)
                os.close(self._write_fd)


def _stop(pool: ThreadPoolExecutor, children: list[subprocess.Popen], wakeup: _Wakeup) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    for child in children:
        _kill(child)
    wakeup.close()


def _kill(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    for stream in (child.stdin, child.stdout):
        stream.close()


def make_backend(name: str, table: Sequence[bytes | None], eos_token_id: int,
                 encode: Callable[[str], list[int]]) -> GrammarBackend:
    """The `--grammar-backend` named `name` over a vocabulary's token bytes (`vocabulary.token_bytes`:
    None for ids never allowed), its EOS and its tokenizer (text -> ids, no special tokens). Each
    backend's module (and so its library) is imported only when that backend is made."""
    if name == "outlines":
        from radixlm.runtime.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend(table, eos_token_id)
    if name == "llguidance":
        from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(table, eos_token_id, encode)
    if name == "xgrammar":
        from radixlm.runtime.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(table, eos_token_id)
    raise ValueError(f"grammar backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {name!r}")


def compiler_factory(tokenizer: object, vocab_size: int, eos_token_ids: Sequence[int], timeout_s: float = 30.0,
                     backend: str = ServerArgs.grammar_backend):
    """A zero-argument maker of the GrammarCompiler on the `--grammar-backend` named `backend`, for
    the scheduler to call on first use."""

    def make() -> GrammarCompiler:
        from radixlm.runtime.constrained.vocabulary import token_bytes

        if not eos_token_ids:
            raise ValueError("constrained decoding needs at least one EOS token id")

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        table = token_bytes(tokenizer, vocab_size, eos_token_ids)  # one pass over the vocabulary, shared
        jump = JumpForward(table, eos_token_ids[0], encode, pre_splitter(tokenizer))
        return GrammarCompiler(make_backend(backend, table, eos_token_ids[0], encode), timeout_s=timeout_s,
                               jump_forward=jump)

    return make


def pre_splitter(tokenizer: object) -> Callable[[str], list[int]] | None:
    """Where a fast tokenizer's pre-tokens start (character offsets), or None when it has no
    pre-tokenizer or normalizes text first (offsets would not be into the text itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None or backend.normalizer is not None:
        return None
    return lambda text: [start for _, (start, _) in pre.pre_tokenize_str(text)]


def grammar_bitmask(rows: Sequence[Matcher | None], vocab_size: int) -> torch.Tensor | None:
    """[B, ceil(V/32)] int32 bitmask of allowed tokens per row (all ones for unconstrained rows),
    or None when no row is constrained. Each matcher class fills all its rows in one call."""
    if all(r is None for r in rows):
        return None
    mask = allocate_mask(len(rows), vocab_size)
    fill_rows(mask, [(i, matcher) for i, matcher in enumerate(rows) if matcher is not None])
    return mask


def fill_rows(mask: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Each (row, matcher)'s allowed tokens into `mask[row]`, one call per matcher class."""
    by_class: dict[type, list[tuple[int, Matcher]]] = {}
    for i, matcher in rows:
        by_class.setdefault(type(matcher), []).append((i, matcher))
    for cls, group in by_class.items():
        cls.fill_masks(group, mask)

