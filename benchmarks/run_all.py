"""Every workload on every system, in one run: tables and plots in benchmarks/results/.

    python benchmarks/run_all.py            # the full run (about 40 minutes on 2 cores)
    python benchmarks/run_all.py --quick    # tiny sizes, proves the scripts work (CI)
    python benchmarks/run_all.py --only mmlu,chat --systems radixlm,hf-static
    python benchmarks/run_all.py --replot     # redraw the PNGs from results/summary.json
    python benchmarks/run_all.py --only online  # only the online section (with --quick: a few requests)
    python benchmarks/run_all.py --only online --models smollm2,1b-q4_0,8b-q4_0  # ... on these files

Systems:
- radixlm: each program workload as a `radixlm.lang` program (`run_batch` on the
  `Runtime` backend); the no-sharing workload as raw requests from a closed loop
  of clients. Default policy (`lpm`), radix cache on; also `radixlm fcfs`,
  `radixlm no-cache` (`disable_radix_cache`), and for JSON `radixlm
  no-jump-forward`.
- hf-static: Hugging Face `transformers` on the same fp32 weights, static
  batches of 32 requests (left-padded; a batch decodes until its longest
  request is done; `select` scores 8 prompts x their choices per pass), no
  cache across requests.
- llama.cpp: `llama-server` on the same GGUF file, 32 parallel slots
  (continuous batching, its own per-slot prompt cache), with its defaults
  (repacked weights; `--no-repack` only where those do not start, said beside
  every ratio against it), when
  benchmarks/baselines/bin/llama-server or $LLAMA_SERVER exists (see
  benchmarks/baselines/install_llama_cpp.sh); skipped with a note otherwise.

Systems without a DSL replay radixlm's trace: every request the programs
made, with the text radixlm sent and exactly the number of tokens it generated
(so the work is identical), in the same dependency order. A request depends on
the earlier requests of its program that finished before it started; the
replay groups a program's requests by text lineage (a later request's prompt
extends an earlier one's). hf-static runs each dependency level of all
programs as static batches; llama.cpp runs every program as its own client,
the requests of one level concurrently. `select` becomes a scoring pass (HF:
the same normalized logprob; llama.cpp, which has no prompt logprobs, a
1-token completion of each prompt + choice: the same prefill work, no pick).
Constraints (regex, JSON schema) are not replayed: the baselines generate the
same number of unconstrained tokens.

Online section (`online`): `radixlm bench serve`'s client (runtime/bench_serve.py)
at fixed concurrency against `radixlm serve` and then `llama-server` (the
llama.cpp system, started as in the offline section), each alone on the machine, on the same GGUF: OpenAI
`/v1/completions`, token-id prompts, streamed, greedy, `ignore_eos`, so both
make every token. Three workloads: one stream; 32 streams with no sharing; 16
streams over 4 interleaved groups that each share a ~1,000-token system prompt.
By default on the embedded SmolLM2 file; `--models` names others (make_models.py's
real-shaped files by name, from `--models-dir`, or GGUF paths), each served in turn
and reported in a table of its own. `radixlm fp32` runs on the embedded file alone
(fp32 copies of the 1B and 8B shapes take 4 and 32 GB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.append(ROOT)  # after site-packages: kernels/ must not shadow the installed `kernels`
import radixlm as rl  # noqa: E402
from radixlm.lang.backends.base import Call  # noqa: E402
from machine import FEATURES, cpu_info  # noqa: E402
from make_models import DEFAULT_FOLDER, EMBEDDED, resolve  # noqa: E402
from offline_throughput import hf_generate, load_hf  # noqa: E402
from radixlm.runtime import bench_serve  # noqa: E402
from radixlm.runtime.launch import free_port, wait_until_serving  # noqa: E402
from radixlm.runtime.model_config import default_model_path  # noqa: E402
from workloads import Workload, all_workloads  # noqa: E402

OFFLINE = "offline"  # the offline section's key among the llama.cpp runs' flags (the online ones: by model)

HF_BATCH = 32
HF_SCORE_BATCH = 8  # prompts per scoring pass (x4 choices = 32 rows): bigger padded passes were slower per row
RADIXLM_SYSTEMS = {
    "radixlm": {},
    "radixlm fcfs": {"schedule_policy": "fcfs"},
    "radixlm no-cache": {"disable_radix_cache": True},
    "radixlm no-jump-forward": {"disable_jump_forward": True},
}
OPTIONAL = {"radixlm no-jump-forward"}  # runs only the workloads that name it
ALL_SYSTEMS = [*RADIXLM_SYSTEMS, "hf-static", "llama.cpp"]
ONLINE = "online"  # the --only name of the online section
# radixlm as served (its defaults: a GGUF's own quantization) and with fp32 weights, then the peer
ONLINE_SYSTEMS = ["radixlm", "radixlm fp32", "llama.cpp"]
ONLINE_FP32 = ("--quantization", "none")


# ---- what a run records ---------------------------------------------------------------------------

@dataclass
class Request:
    """One request of a trace: what was asked, how much it made, when it ran."""

    text: str | None  # the prompt (program workloads) ...
    ids: list[int] | None  # ... or its token ids (raw workloads)
    new_tokens: int
    choices: list[str] | None = None
    pick: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    start: float = 0.0
    end: float = 0.0
    program: int = 0
    level: int = 0


@dataclass
class Result:
    workload: str
    system: str
    wall_s: float
    programs: int
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    latencies_s: list[float] = field(default_factory=list)  # per program (or raw request), from the start
    same_pick: float | None = None  # select workloads: share of picks equal to radixlm's
    note: str = ""

    @property
    def throughput(self) -> float:
        return self.programs / self.wall_s

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class Recorder(rl.Backend):
    """A backend that passes every call through and records it (not `cache_prefix`'s empty ones:
    they are an optimization, not work a baseline would replay)."""

    def __init__(self, inner: rl.Backend) -> None:
        self.inner = inner
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def generate(self, call: Call) -> dict[str, Any]:
        start = time.perf_counter()
        result = self.inner.generate(call)
        end = time.perf_counter()
        params = call.sampling_params
        choices = params.get("choices")
        if choices is None and params.get("max_new_tokens") == 0:
            return result
        meta = result["meta_info"]
        request = Request(call.text, None, 0 if choices else meta["completion_tokens"], choices,
                          meta.get("selected_index"), meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0),
                          start, end)
        self.add(request)
        return result

    def add(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def stream(self, call: Call):
        return self.inner.stream(call)

    def model_info(self) -> dict[str, Any]:
        return self.inner.model_info()


def link(requests: list[Request]) -> int:
    """Group a trace's requests into programs (by prompt lineage) and give each its dependency
    level: one more than the deepest earlier request of its program that ended before it began.
    Returns the number of programs."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].start)
    parent = list(range(len(requests)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, i in enumerate(order):
        for j in order[:a]:
            if requests[i].text.startswith(requests[j].text):
                parent[root(i)] = root(j)
    roots = {r: n for n, r in enumerate(dict.fromkeys(root(i) for i in order))}
    for a, i in enumerate(order):
        r = requests[i]
        r.program = roots[root(i)]
        r.level = max((requests[j].level + 1 for j in order[:a]
                       if requests[j].program == r.program and requests[j].end <= r.start), default=0)
    return len(roots)


def program_latencies(requests: list[Request], ends: list[float], t0: float) -> list[float]:
    """Each program's latency: from t0 to the end of its last request."""
    last: dict[int, float] = defaultdict(float)
    for r, e in zip(requests, ends):
        last[r.program] = max(last[r.program], e - t0)
    return [last[p] for p in sorted(last)]


# ---- radixlm ----------------------------------------------------------------------------------------

def run_radixlm(backend: rl.Runtime, w: Workload, system: str) -> tuple[Result, list[Request]]:
    backend.flush_cache()
    recorder = Recorder(backend)
    start = time.perf_counter()
    if w.program is not None:
        states = w.program.run_batch(w.args, backend=recorder)
        failed = [st.error() for st in states if st.error() is not None]
        if failed:
            raise RuntimeError(f"{system} on {w.name}: {len(failed)} programs failed, first: {failed[0]}")
    else:
        closed_loop(w, lambda i: _engine_request(backend, recorder, *w.requests[i]))
    wall = time.perf_counter() - start
    reqs = recorder.requests
    if w.program is not None:
        link(reqs)
        latencies = program_latencies(reqs, [r.end for r in reqs], start)
    else:
        latencies = [r.end - start for r in reqs]
    accounting = backend.engine.check_accounting()
    if not accounting.get("ok"):
        raise RuntimeError(f"{system} on {w.name}: KV accounting failed: {accounting}")
    return Result(w.name, system, wall, w.size, sum(r.new_tokens for r in reqs), sum(r.prompt_tokens for r in reqs),
                  sum(r.cached_tokens for r in reqs), latencies), reqs


def _engine_request(backend: rl.Runtime, recorder: Recorder, ids: list[int], n: int) -> None:
    start = time.perf_counter()
    meta = backend.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                                    "ignore_eos": True})["meta_info"]
    request = Request(None, ids, meta["completion_tokens"], prompt_tokens=meta["prompt_tokens"],
                      cached_tokens=meta["cached_tokens"], start=start, end=time.perf_counter())
    recorder.add(request)


def closed_loop(w: Workload, send: Callable[[int], None]) -> None:
    """`w.concurrency` clients, each sending its next request (by index) when the last one is done."""
    with ThreadPoolExecutor(w.concurrency) as pool:
        for f in [pool.submit(send, i) for i in range(w.size)]:
            f.result()


# ---- hf-static ----------------------------------------------------------------------------------------

class HFStatic:
    name = "hf-static"

    def __init__(self, path: str) -> None:
        from radixlm.runtime.tokenizer.loader import load_tokenizer
        from radixlm.runtime.model_config import resolve_model

        self.tokenizer = load_tokenizer(resolve_model(path))  # transformers' conversion, cached
        self.model = load_hf(path)
        self.pad = self.tokenizer.eos_token_id
        hf_generate(self.model, [[100] * 8, [200] * 12], 4, self.pad)  # warm up

    def run(self, w: Workload, trace: list[Request]) -> Result:
        start = time.perf_counter()
        if w.program is None:
            ends, picks = [], None
            for i in range(0, len(w.requests), HF_BATCH):
                batch = w.requests[i:i + HF_BATCH]
                hf_generate(self.model, [ids for ids, _ in batch], max(n for _, n in batch), self.pad)
                ends += [time.perf_counter()] * len(batch)
        else:
            ends, picks = self._replay(trace)
        wall = time.perf_counter() - start
        return _replay_result(w, self.name, wall, trace, ends, start, picks)

    def _replay(self, trace: list[Request]) -> tuple[list[float], list[int | None]]:
        """Each dependency level of all programs as static batches; returns end times and picks."""
        ends = [0.0] * len(trace)
        picks: list[int | None] = [None] * len(trace)
        for level in range(max(r.level for r in trace) + 1):
            gens = [i for i, r in enumerate(trace) if r.level == level and r.choices is None and r.new_tokens]
            selects = [i for i, r in enumerate(trace) if r.level == level and r.choices is not None]
            for b in range(0, len(gens), HF_BATCH):
                batch = gens[b:b + HF_BATCH]
                hf_generate(self.model, [self._ids(trace[i].text) for i in batch],
                            max(trace[i].new_tokens for i in batch), self.pad)
                for i in batch:
                    ends[i] = time.perf_counter()
            for b in range(0, len(selects), HF_SCORE_BATCH):
                batch = selects[b:b + HF_SCORE_BATCH]
                for i, pick in zip(batch, self._score([trace[i] for i in batch])):
                    picks[i], ends[i] = pick, time.perf_counter()
        return ends, picks

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _score(self, requests: list[Request]) -> list[int]:
        """Every prompt + choice as one padded forward pass; the pick maximizes the choice tokens'
        mean logprob (what `select` does by default)."""
        rows, spans = [], []
        for r in requests:
            prompt = self._ids(r.text)
            for choice in r.choices:
                full = self._ids(r.text + choice)
                keep = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
                keep = min(keep, len(full) - 1)
                rows.append(full)
                spans.append(keep)
        width = max(map(len, rows))
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            logprobs = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        scores = []
        for n, (row, keep) in enumerate(zip(rows, spans)):
            offset = width - len(row)
            positions = torch.arange(offset + keep, offset + len(row))
            targets = torch.tensor(row[keep:])
            scores.append(logprobs[n, positions - 1, targets].mean().item())
        picks, k = [], 0
        for r in requests:
            picks.append(int(np.argmax(scores[k:k + len(r.choices)])))
            k += len(r.choices)
        return picks


def _replay_result(w: Workload, system: str, wall: float, trace: list[Request], ends: list[float], t0: float,
                   picks: list[int | None] | None, tokens: tuple[int, int] | None = None, note: str = "") -> Result:
    """`tokens`: (prompt, cached) as the system counted them; default radixlm's prompt count, none cached."""
    latencies = [e - t0 for e in ends] if w.program is None else program_latencies(trace, ends, t0)
    same = None
    if picks is not None:
        pairs = [(p, r.pick) for p, r in zip(picks, trace) if r.choices is not None and p is not None]
        same = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    prompt, cached = tokens or (sum(r.prompt_tokens for r in trace), 0)
    return Result(w.name, system, wall, w.size, sum(r.new_tokens for r in trace), prompt, cached, latencies, same,
                  note)


# ---- llama.cpp ---------------------------------------------------------------------------------------

def llama_server_binary() -> str | None:
    path = os.environ.get("LLAMA_SERVER") or os.path.join(HERE, "baselines", "bin", "llama-server")
    return path if os.path.exists(path) else shutil.which("llama-server")


def llama_server_command(binary: str, gguf: str, port: int, slots: int, slot_context: int, *extra: str) -> list[str]:
    """`slots` parallel sequences of `slot_context` tokens each (llama-server splits -c among -np)."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(os.cpu_count() or 1),
            "-np", str(slots), "-c", str(slots * slot_context), *extra]


def llama_cpp_version(binary: str) -> str:
    """What `llama-server --version` prints, and the install script's VERSION file beside it."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    version_file = os.path.join(os.path.dirname(binary), "VERSION")
    if os.path.exists(version_file):
        with open(version_file) as f:
            lines.append(f"VERSION: {f.read().strip()}")
    return "; ".join(lines)


def radixlm_serve_command(port: int, model: str | None = None, *extra: str) -> list[str]:
    """`radixlm serve` on `port` (the embedded model where `model` is None)."""
    return [sys.executable, "-m", "radixlm.runtime.cli", "serve", "--port", str(port),
            *(["--model-path", model] if model else []), *extra]


def start_server(name: str, command: list[str], port: int) -> tuple[subprocess.Popen, str]:
    """Start a server process in its own session (so its children can be stopped with it), its output
    to a log file; returns the process and the log's path."""
    print(f"{name}: {shlex.join(command)}", flush=True)
    log_path = os.path.join(tempfile.gettempdir(), f"run_all-{name.replace(' ', '-')}-{port}.log")
    with open(log_path, "w") as log:
        return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log_path


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # its own session: the group is its children, nothing else
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_serving(name: str, command: list[str], port: int) -> tuple[subprocess.Popen, str]:
    """A server process and its URL once /health answers; a failed start is stopped and reports
    its log's tail."""
    url = f"http://127.0.0.1:{port}"
    proc, log_path = start_server(name, command, port)
    try:
        wait_until_serving(url, proc, timeout=300)
    except RuntimeError as e:
        stop_server(proc)
        with open(log_path) as f:
            raise RuntimeError(f"{name}: {e}; {log_path} ends: {f.read()[-1500:]}") from None
    return proc, url


@contextmanager
def serving(name: str, command: list[str], port: int) -> Iterator[str]:
    """Run a server process until the block ends; yields its URL once /health answers."""
    proc, url = start_serving(name, command, port)
    try:
        yield url
    finally:
        stop_server(proc)


LLAMA_DEFAULTS, LLAMA_NO_REPACK = "its defaults", "--no-repack: its defaults did not start"


@contextmanager
def serving_llama_cpp(binary: str, gguf: str, slots: int, slot_context: int,
                      *extra: str) -> Iterator[tuple[str, str, list[str]]]:
    """llama-server as its users get it: its defaults (weights repacked for its kernels, its fast
    path on AVX2 and AVX-512); only where those do not start (a crash in the repacked path on some
    CPUs), again with `--no-repack`. Yields its URL, which of the two ran (printed beside every
    ratio) and the command."""
    failure = RuntimeError("llama.cpp did not start")
    for flags, which in (((), LLAMA_DEFAULTS), (("--no-repack",), LLAMA_NO_REPACK)):
        port = free_port()
        command = llama_server_command(binary, gguf, port, slots, slot_context, *flags, *extra)
        try:
            proc, url = start_serving("llama.cpp", command, port)
        except RuntimeError as e:
            failure = e
            print(f"llama.cpp did not start with {which.split(':')[0]}: {e}", flush=True)
            continue
        try:
            yield url, which, command
        finally:
            stop_server(proc)
        return
    raise failure


class LlamaCpp:
    """The offline section's llama.cpp system: replays radixlm's trace against a llama-server at `url`."""

    name = "llama.cpp"

    def __init__(self, url: str) -> None:
        import httpx

        self.client = httpx.Client(base_url=url, timeout=None, limits=httpx.Limits(max_connections=256))
        self.complete("Hello", 4)  # warm up

    def complete(self, prompt: str | list[int], n: int) -> tuple[int, int]:
        """One completion of exactly n tokens; returns (prompt tokens, cached tokens)."""
        r = self.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                      "ignore_eos": True, "cache_prompt": True})
        r.raise_for_status()
        usage = r.json()["usage"]
        if usage["completion_tokens"] != n:
            raise RuntimeError(f"llama-server made {usage['completion_tokens']} tokens, asked for {n}")
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def run(self, w: Workload, trace: list[Request]) -> Result:
        ends = [0.0] * len(trace)
        tokens = [(0, 0)] * len(trace)  # (prompt, cached) as llama-server counts them

        def one(i: int) -> None:
            r = trace[i]
            if r.choices is None:
                tokens[i] = self.complete(r.text, r.new_tokens)
            else:
                tokens[i] = tuple(map(sum, zip(*(self.complete(r.text + c, 1) for c in r.choices))))
            ends[i] = time.perf_counter()

        def raw(i: int) -> None:
            ids, n = w.requests[i]
            tokens[i] = self.complete(ids, n)
            ends[i] = time.perf_counter()

        start = time.perf_counter()
        if w.program is None:
            closed_loop(w, raw)
        else:
            by_program: dict[int, list[int]] = defaultdict(list)
            for i, r in enumerate(trace):
                by_program[r.program].append(i)

            def program(indices: list[int]) -> None:
                for level in sorted({trace[i].level for i in indices}):
                    same = [i for i in indices if trace[i].level == level]
                    with ThreadPoolExecutor(len(same)) as pool:
                        list(pool.map(one, same))

            with ThreadPoolExecutor(min(64, len(by_program))) as pool:
                list(pool.map(program, by_program.values()))
        wall = time.perf_counter() - start
        note = "select replayed as 1-token completions (no pick)" if any(r.choices for r in trace) else ""
        prompt, cached = map(sum, zip(*tokens))
        return _replay_result(w, self.name, wall, trace, ends, start, None, (prompt, cached), note)

    def close(self) -> None:
        self.client.close()


# ---- online: `radixlm bench serve` at fixed concurrency, one server at a time ---------------------------

@dataclass(frozen=True)
class OnlineWorkload:
    """One `bench serve` run: `num` requests, `concurrency` in flight, exact lengths."""

    name: str
    concurrency: int
    num: int
    input_len: int  # each request's own tokens, after its group's system prompt
    output_len: int
    seed: int
    prefix_len: int = 0
    groups: int = 0  # > 0: `groups` distinct system prompts of `prefix_len` tokens, requests interleaved
    compared: str = "output_tok_s"  # the summary field of the radixlm / llama.cpp ratio

    @property
    def description(self) -> str:
        shared = (f"{self.groups} groups x {self.num // self.groups}, each with its own {self.prefix_len}-token "
                  "system prompt + " if self.groups else "")
        streams = f"{self.concurrency} stream{'s' if self.concurrency > 1 else ''}"
        return f"{streams}, {self.num} requests: {shared}{self.input_len} in / {self.output_len} out"

    def requests(self) -> list[bench_serve.Request]:
        return bench_serve.make_requests("shared-prefix" if self.groups else "random", self.num, self.input_len,
                                         self.output_len, 0.0, self.prefix_len, self.seed,
                                         num_groups=max(1, self.groups))


def online_workloads(quick: bool) -> list[OnlineWorkload]:
    if quick:
        return [OnlineWorkload("one-stream", 1, 2, 32, 16, seed=1),
                OnlineWorkload("no-sharing", 4, 8, 32, 16, seed=2),
                OnlineWorkload("shared-prompts", 4, 8, 16, 8, seed=3, prefix_len=128, groups=2,
                               compared="request_throughput")]
    return [OnlineWorkload("one-stream", 1, 8, 128, 128, seed=1),
            OnlineWorkload("no-sharing", 32, 64, 128, 128, seed=2),
            OnlineWorkload("shared-prompts", 16, 64, 64, 32, seed=3, prefix_len=1000, groups=4,
                           compared="request_throughput")]


@dataclass
class OnlineResult:
    workload: str
    system: str
    summary: dict[str, Any]  # bench_serve.summarize's
    expected_tokens: int  # the output tokens the requests asked for
    model: str = EMBEDDED  # the file's name in --models

    @property
    def note(self) -> str:
        s = self.summary
        if s["failed"]:
            return f"{s['failed']} failed: {s['errors'][0][:120]}"
        if s["output_tokens"] != self.expected_tokens:
            return f"made {s['output_tokens']} of {self.expected_tokens} output tokens"
        return ""

    @property
    def valid(self) -> bool:
        """Every request done with every token: the numbers compare with another system's."""
        return not self.note


def run_online(system: str, url: str, workloads: list[OnlineWorkload], model: str) -> list[OnlineResult]:
    """Each workload through bench serve's OpenAI client (the same body for both servers)."""

    def bench(requests: list[bench_serve.Request], concurrency: int) -> dict[str, Any]:
        outcomes, duration = asyncio.run(bench_serve.run(url, "openai", requests, float("inf"), concurrency))
        return bench_serve.summarize(outcomes, duration)

    bench(bench_serve.make_requests("random", 2, 16, 4, 0.0, 0, seed=0), 2)  # warm up
    results = []
    for w in workloads:
        requests = w.requests()
        r = OnlineResult(w.name, system, bench(requests, w.concurrency), sum(q.output_len for q in requests), model)
        results.append(r)
        s = r.summary
        print(f"online {model} {w.name:<16} {system:<10} {s['output_tok_s']:7.1f} out tok/s  "
              f"{s['request_throughput']:6.2f} req/s  TTFT p50 {s['ttft_ms']['p50']:7.1f} ms  "
              f"TPOT p50 {s['tpot_ms']['p50']:6.1f} ms  {r.note}", flush=True)
    return results


def online_section(workloads: list[OnlineWorkload], systems: list[str], models: dict[str, str],
                   llama_binary: str | None, notes: list[str], commands: dict[str, dict[str, str]],
                   llama_flags: dict[str, str]) -> list[OnlineResult]:
    """On each model file in turn: radixlm's server (its defaults; on the embedded file then with fp32
    weights), then llama-server (its defaults, one slot per stream; `serving_llama_cpp`), each alone
    on the machine. `llama_flags` gets which llama.cpp ran on each model."""
    results: list[OnlineResult] = []
    for model, path in models.items():
        commands[model] = {}
        for system, extra in (("radixlm", ()), ("radixlm fp32", ONLINE_FP32)):
            if "radixlm" not in systems or (extra and model != EMBEDDED):
                continue
            port = free_port()
            command = radixlm_serve_command(port, None if model == EMBEDDED else path, *extra)
            commands[model][system] = shlex.join(command)
            with serving(system, command, port) as url:
                results += run_online(system, url, workloads, model)
        if "llama.cpp" in systems and llama_binary:
            try:
                with serving_llama_cpp(llama_binary, path, max(w.concurrency for w in workloads), 2048) as (url, which,
                                                                                                           llama):
                    commands[model]["llama.cpp"] = shlex.join(llama)
                    llama_flags[model] = which
                    results += run_online("llama.cpp", url, workloads, model)
            except RuntimeError as e:  # e.g. a crash in its CPU kernels: radixlm's rows still stand
                notes.append(f"online llama.cpp rows on {model} skipped: {e}")
                print(notes[-1], flush=True)
    return results


def online_pair(online: dict[tuple[str, str], OnlineResult], workload: str) -> tuple[OnlineResult, OnlineResult] | None:
    """radixlm's and llama.cpp's results on one workload, if both ran cleanly."""
    a, b = online.get((workload, "radixlm")), online.get((workload, "llama.cpp"))
    return (a, b) if a and b and a.valid and b.valid else None


def online_ratio(online: dict[tuple[str, str], OnlineResult], workload: str, key: str) -> float | None:
    """radixlm's summary[key] over llama.cpp's."""
    pair = online_pair(online, workload)
    return pair[0].summary[key] / pair[1].summary[key] if pair and pair[1].summary[key] else None


def cpu_description() -> str:
    """/proc/cpuinfo's model name and which of the features that pick CPU kernels it has."""
    model, features = cpu_info()
    return f"{model}; features {' '.join(features) or 'none of ' + ' '.join(FEATURES)}"


def by_model(online: list[OnlineResult]) -> dict[str, dict[tuple[str, str], OnlineResult]]:
    """Each model's results by (workload, system)."""
    out: dict[str, dict[tuple[str, str], OnlineResult]] = defaultdict(dict)
    for r in online:
        out[r.model][(r.workload, r.system)] = r
    return out


def online_report(online: list[OnlineResult], workloads: list[OnlineWorkload], meta: dict[str, Any]) -> list[str]:
    lines = ["## Online: `radixlm bench serve` at fixed concurrency", "",
             f"CPU: {meta['cpu']}. llama.cpp: {meta.get('llama_cpp_version') or 'not run'}.", "",
             "Each server alone on the machine, warmed up, then each workload through bench serve's OpenAI "
             "client: `/v1/completions`, token-id prompts, streamed, greedy, `ignore_eos`. The ratio is "
             "radixlm's over llama.cpp's output tok/s (request/s for shared-prompts).", ""]
    for model, by in by_model(online).items():
        path = meta["online_models"][model]
        lines += [f"### {model}: {os.path.basename(path)}, {os.path.getsize(path) / 1e6:.0f} MB", ""]
        lines += [f"- {system}: `{command}`" for system, command in meta["online_commands"][model].items()]
        flags = meta["llama_flags"].get(model)
        lines += ["", "| workload | what | system | output tok/s | request/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
                  f"TPOT p99 ms | cache hit | radixlm / llama.cpp{f' ({flags})' if flags else ''} | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for w in workloads:
            for system in ONLINE_SYSTEMS:
                r = by.get((w.name, system))
                if r is None:
                    continue
                s, ttft, tpot = r.summary, r.summary["ttft_ms"], r.summary["tpot_ms"]
                speedup = online_ratio(by, w.name, w.compared) if system == "radixlm" else None
                lines.append(f"| {w.name} | {w.description} | {system} | {s['output_tok_s']:.1f} | "
                             f"{s['request_throughput']:.2f} | {ttft['p50']:.1f} | {ttft['p99']:.1f} | {tpot['p50']:.1f} | "
                             f"{tpot['p99']:.1f} | {pct(s['cache_hit_rate'])} | "
                             f"{'-' if speedup is None else f'{speedup:.2f}x'} | {r.note} |")
        lines.append("")
    return lines


# ---- report ------------------------------------------------------------------------------------------

def ratio(a: Result | None, b: Result | None) -> str:
    return f"{a.throughput / b.throughput:.2f}x" if a and b else "-"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def report(results: list[Result], workloads: list[Workload], online_results: list[OnlineResult],
           online: list[OnlineWorkload], meta: dict[str, Any]) -> str:
    offline_model = ("SmolLM2-135M-Instruct (radixlm and HF: fp32 from the Q4_1 GGUF; llama.cpp: Q4_1 itself), "
                     if results else "")
    lines = [f"# radixlm benchmarks{' (quick)' if meta['quick'] else ''}", "",
             f"`{meta['command']}` — {meta['date']}, {meta['machine']}, {offline_model}load average "
             f"{meta['load_before']:.1f} before, {meta['load_after']:.1f} after.", ""]
    if results:
        lines += offline_report(results, workloads, meta["llama_flags"].get(OFFLINE))
    if online_results:
        lines += online_report(online_results, online, meta)
    by = {(r.workload, r.system): r for r in results}
    lines += [*targets(by, by_model(online_results), meta["llama_flags"]), "", *meta["notes"]]
    return "\n".join(lines) + "\n"


def offline_report(results: list[Result], workloads: list[Workload], llama_flags: str | None) -> list[str]:
    by = {(r.workload, r.system): r for r in results}
    systems = [s for s in ALL_SYSTEMS if any(r.system == s for r in results)]
    lines = ["Throughput is programs (or raw requests) per second; a ratio is radixlm's throughput over the "
             "other system's, on the same work in the same run.", "",
             "| workload | what | radixlm /s | vs hf-static | vs no-cache | vs fcfs | "
             f"vs llama.cpp{f' ({llama_flags})' if llama_flags else ''} | radixlm cache hit |",
             "|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        ours = by.get((w.name, "radixlm"))
        if ours is None:
            continue
        lines.append(f"| {w.name} | {w.description} | {ours.throughput:.2f} | "
                     f"{ratio(ours, by.get((w.name, 'hf-static')))} | {ratio(ours, by.get((w.name, 'radixlm no-cache')))} | "
                     f"{ratio(ours, by.get((w.name, 'radixlm fcfs')))} | {ratio(ours, by.get((w.name, 'llama.cpp')))} | "
                     f"{pct(ours.hit_rate)} |")
    lines += ["", "| workload | system | wall s | /s | output tok/s | latency p50 s | p90 s | cache hit | same pick | note |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        for s in systems:
            r = by.get((w.name, s))
            if r is None:
                continue
            p50, p90 = np.percentile(r.latencies_s, [50, 90]) if r.latencies_s else (0.0, 0.0)
            lines.append(f"| {w.name} | {s} | {r.wall_s:.1f} | {r.throughput:.2f} | {r.output_tokens / r.wall_s:.1f} | "
                         f"{p50:.1f} | {p90:.1f} | {pct(r.hit_rate)} | {pct(r.same_pick)} | {r.note} |")
    return lines + [""]


def targets(by: dict[tuple[str, str], Result], models: dict[str, dict[tuple[str, str], OnlineResult]],
            llama_flags: dict[str, str]) -> list[str]:
    """Issue 7's targets and the online section's on the embedded file, issue 46's on any other file
    (the sizes people run), met or not, from this run's numbers; a ratio against llama.cpp says
    which llama.cpp ran (`serving_llama_cpp`)."""
    out = ["Targets:"]
    online = models.get(EMBEDDED, {})

    def check(label: str, value: float | None, goal: float, fmt: str, higher: bool = True, model: str = "") -> None:
        if value is None:
            out.append(f"- {label}: not measured in this run")
            return
        if "llama.cpp" in label and model in llama_flags:
            label += f" ({llama_flags[model]})"
        met = value >= goal if higher else value <= goal
        out.append(f"- {label}: {fmt.format(value)} (target {'≥' if higher else '≤'} {fmt.format(goal)}): "
                   f"{'met' if met else 'missed'}")

    def speedup(w: str, other: str) -> float | None:
        a, b = by.get((w, "radixlm")), by.get((w, other))
        return a.throughput / b.throughput if a and b else None

    check("few-shot (mmlu) vs hf-static", speedup("mmlu", "hf-static"), 8.0, "{:.2f}x")
    check("no sharing, 32 clients, vs hf-static", speedup("no-sharing", "hf-static"), 2.0, "{:.2f}x")
    check("no sharing, 32 clients, vs llama.cpp", speedup("no-sharing", "llama.cpp"), 1.0, "{:.2f}x", model=OFFLINE)
    nocache = speedup("no-sharing", "radixlm no-cache")
    check("radix cache overhead with no sharing (wall, cache on / off - 1)",
          None if nocache is None else 1 / nocache - 1, 0.01, "{:+.1%}", higher=False)
    for model, other in models.items():
        if model != EMBEDDED:
            check(f"{model}: online one stream, output tok/s vs llama.cpp",
                  online_ratio(other, "one-stream", "output_tok_s"), 1.3, "{:.2f}x", model=model)
            check(f"{model}: online no sharing, 32 streams, output tok/s vs llama.cpp",
                  online_ratio(other, "no-sharing", "output_tok_s"), 2.0, "{:.2f}x", model=model)
            check(f"{model}: online shared prompts, request/s vs llama.cpp",
                  online_ratio(other, "shared-prompts", "request_throughput"), 4.0, "{:.2f}x", model=model)
    if models and not online:
        return out
    check("online no sharing, 32 streams, output tok/s vs llama.cpp", online_ratio(online, "no-sharing", "output_tok_s"),
          1.5, "{:.2f}x", model=EMBEDDED)
    pair = online_pair(online, "no-sharing")
    ours, theirs = (pair[0].summary["tpot_ms"]["p50"], pair[1].summary["tpot_ms"]["p50"]) if pair else (None, 0.0)
    check("online no sharing, 32 streams, TPOT p50 vs llama.cpp's", ours, theirs, "{:.1f} ms", higher=False,
          model=EMBEDDED)
    check("online shared prompts, 16 streams, request/s vs llama.cpp",
          online_ratio(online, "shared-prompts", "request_throughput"), 5.0, "{:.2f}x", model=EMBEDDED)
    check("online one stream, output tok/s vs llama.cpp", online_ratio(online, "one-stream", "output_tok_s"),
          1.2, "{:.2f}x", model=EMBEDDED)
    served, fp32 = online.get(("no-sharing", "radixlm")), online.get(("no-sharing", "radixlm fp32"))
    check("online no sharing, 32 streams, output tok/s as served vs fp32 weights",
          served.summary["output_tok_s"] / fp32.summary["output_tok_s"] if served and fp32 and served.valid and fp32.valid
          else None, 1.0, "{:.2f}x")
    return out


def plots(results: list[Result], workloads: list[Workload], out_dir: str) -> list[str]:
    """Three PNGs of the offline section (none if it did not run); each system keeps its colour in all."""
    if not results:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r.workload, r.system): r for r in results}
    names = [w.name for w in workloads if (w.name, "hf-static") in by]
    systems = [s for s in ALL_SYSTEMS if any(r.system == s for r in results)]
    color = {s: f"C{i}" for i, s in enumerate(ALL_SYSTEMS)}
    files = []

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(systems)
    for k, s in enumerate(systems):
        xs = [i + k * width for i, n in enumerate(names) if (n, s) in by]
        ys = [by[(n, s)].throughput / by[(n, "hf-static")].throughput for n in names if (n, s) in by]
        ax.bar(xs, ys, width, label=s, color=color[s])
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names)
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("throughput / hf-static (log)")
    ax.set_title("Programs per second relative to HF static batching, same run")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    files.append(os.path.join(out_dir, "throughput.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    shown = [w.name for w in workloads if any(r.workload == w.name for r in results)]
    cols = 4
    fig, axes = plt.subplots((len(shown) + cols - 1) // cols, cols, figsize=(14, 3.2 * ((len(shown) + cols - 1) // cols)),
                             squeeze=False)
    for ax, n in zip(axes.flat, shown):
        for s in systems:
            r = by.get((n, s))
            if r and r.latencies_s:
                xs = np.sort(r.latencies_s)
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=s, color=color[s])
        ax.set_title(n)
        ax.set_xlabel("latency s")
        ax.set_ylim(0, 1.02)
    for ax in axes.flat[len(shown):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("share of programs done")
    handles = [plt.Line2D([], [], color=color[s], label=s) for s in systems]
    fig.legend(handles=handles, loc="lower right", fontsize=9, bbox_to_anchor=(0.98, 0.08))
    fig.tight_layout()
    files.append(os.path.join(out_dir, "latency_cdf.png"))
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    hit_systems = [s for s in systems if s != "hf-static"]
    width = 0.8 / max(1, len(hit_systems))
    for k, s in enumerate(hit_systems):
        pairs = [(i, by[(n, s)].hit_rate) for i, n in enumerate(shown) if (n, s) in by and by[(n, s)].hit_rate is not None]
        ax.bar([i + k * width for i, _ in pairs], [h for _, h in pairs], width, label=s, color=color[s])
    ax.set_xticks([i + width * (len(hit_systems) - 1) / 2 for i in range(len(shown))], shown)
    ax.set_ylabel("prompt tokens from cache")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    files.append(os.path.join(out_dir, "cache_hit.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def replot(out_dir: str) -> None:
    with open(os.path.join(out_dir, "summary.json")) as f:
        saved = json.load(f)["results"]
    fields = {f for f in Result.__dataclass_fields__}
    results = [Result(**{k: v for k, v in r.items() if k in fields}) for r in saved]
    names = list(dict.fromkeys(r.workload for r in results))
    files = plots(results, [Workload(n, "") for n in names], out_dir)
    print("wrote", ", ".join(files) if files else "nothing: the file has no offline results to plot")


# ---- main -----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI); writes to benchmarks/results/quick/")
    ap.add_argument("--only", default="", help=f"comma-separated workloads, {ONLINE!r} for the online section "
                                                "(default: all and the online section)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma-separated systems (default: all)")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results[/quick])")
    ap.add_argument("--replot", action="store_true", help="redraw the plots from the folder's summary.json, run nothing")
    ap.add_argument("--models", default=EMBEDDED,
                    help=f"the online section's files, comma-separated: {EMBEDDED!r} (the embedded file), names "
                         "make_models.py writes (e.g. 1b-q4_0, 8b-q4_k_m) or GGUF paths (default: %(default)s)")
    ap.add_argument("--models-dir", default=DEFAULT_FOLDER, help="where make_models.py wrote them (default: %(default)s)")
    args = ap.parse_args()
    if args.replot:
        replot(args.out or os.path.join(HERE, "results", *(["quick"] if args.quick else [])))
        return
    torch.set_num_threads(os.cpu_count() or 1)
    only = args.only.split(",") if args.only else []
    workloads = [w for w in all_workloads(args.quick) if not only or w.name in only]
    online = online_workloads(args.quick) if not only or ONLINE in only else []
    systems = args.systems.split(",")
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown or ("radixlm" not in systems and workloads):
        ap.error(f"systems are {ALL_SYSTEMS} and must include radixlm (the baselines replay its trace) unless only "
                 f"the online section runs; got {systems}")
    try:
        models = {model: resolve(model, args.models_dir) for model in args.models.split(",")}
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    out_dir = args.out or os.path.join(HERE, "results", *(["quick"] if args.quick else []))
    os.makedirs(out_dir, exist_ok=True)
    load_before = os.getloadavg()[0]
    notes: list[str] = []
    results: list[Result] = []
    traces: dict[str, list[Request]] = {}

    def add(r: Result) -> None:
        results.append(r)
        print(f"{r.workload:<16} {r.system:<24} {r.wall_s:7.1f} s  {r.throughput:7.2f}/s  "
              f"{r.output_tokens / r.wall_s:7.1f} out tok/s  hit {pct(r.hit_rate)}", flush=True)

    for system, options in RADIXLM_SYSTEMS.items():
        wanted = [w for w in workloads if system not in OPTIONAL or system in w.only]
        if system not in systems or not wanted:
            continue
        backend = rl.Runtime(**options)
        try:
            backend.engine.generate("Warm up", {"max_new_tokens": 4})
            for w in wanted:
                result, trace = run_radixlm(backend, w, system)
                add(result)
                if system == "radixlm":
                    traces[w.name] = trace
        finally:
            backend.shutdown()

    path = default_model_path()
    if "hf-static" in systems and workloads:
        hf = HFStatic(path)
        for w in workloads:
            add(hf.run(w, traces[w.name]))
        del hf
    binary = llama_server_binary() if "llama.cpp" in systems else None
    if "llama.cpp" in systems and binary is None:
        notes.append("llama.cpp: no llama-server binary (bash benchmarks/baselines/install_llama_cpp.sh builds "
                     "one); its rows are skipped.")
        print(notes[-1])
    llama_flags: dict[str, str] = {}  # which llama.cpp ran: OFFLINE's and each online model's
    if binary and workloads:
        with serving_llama_cpp(binary, path, 32, 2048, "--no-webui") as (url, llama_flags[OFFLINE], _):
            server = LlamaCpp(url)
            try:
                for w in workloads:
                    add(server.run(w, traces[w.name]))
            finally:
                server.close()

    online_results: list[OnlineResult] = []
    commands: dict[str, dict[str, str]] = {}
    meta = {"command": shlex.join(["python", "benchmarks/run_all.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick, "notes": notes,
            "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__} with {torch.get_num_threads()} threads",
            "cpu": cpu_description(), "llama_cpp_version": llama_cpp_version(binary) if binary else None,
            "online_commands": commands, "online_models": models, "load_before": load_before,
            "llama_flags": llama_flags}
    if online:
        print(f"CPU: {meta['cpu']}\nllama.cpp: {meta['llama_cpp_version'] or 'not run'}", flush=True)
        online_results = online_section(online, systems, models, binary, notes, commands, llama_flags)
    meta["load_after"] = os.getloadavg()[0]
    text = report(results, workloads, online_results, online, meta)
    stem = "summary" if results else "online"  # an online-only run leaves the full run's summary alone
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) | {"throughput": r.throughput} for r in results],
                   "online": [asdict(r) | {"note": r.note} for r in online_results]}, f, indent=1)
    files = plots(results, workloads, out_dir)
    print("\n" + text)
    print("wrote", ", ".join([os.path.join(out_dir, f"{stem}.md"), os.path.join(out_dir, f"{stem}.json"), *files]))


if __name__ == "__main__":
    main()
