"""Start-up and memory per model file: `radixlm serve` beside `llama-server` on the same GGUF with the
same context tokens, one server at a time.

    python benchmarks/memory.py                                  # smollm2,1b-q4_0,8b-q4_0, both servers
    python benchmarks/memory.py --models 1b-q4_k_m --systems llama.cpp
    python benchmarks/memory.py --quick                          # SmolLM2, radixlm alone

Each server is started alone (`radixlm serve --max-total-tokens C`; llama-server with `-c C` and
its defaults, `-t` the core count, `-np` as run_all.py's online section starts it), on a warm page
cache (the file is read once before each start), and measured:

- ready: from the process's start to /health answering 200 (radixlm's HTTP server starts once the
  model is loaded; llama-server answers 503 while it loads);
- peak: the highest PSS of the process tree (the server and every descendant: radixlm's tokenizer
  and scheduler processes), the sum of each process's /proc/PID/smaps_rollup, sampled every 0.3 s
  from the start through one request;
- after a request: the highest PSS over the 3 s after one short completion (8 tokens), the steady
  state a served model holds.

A server is stopped when the machine's available memory falls under --min-available-gb (3 GB; others
may share the machine), and its row says so. The after-a-request cell also says how much of the PSS
is mapped files' pages (llama-server maps the GGUF; where it repacks weights for its kernels, the
default on x86 CPUs with AVX2, it holds both the pages it read and the repacked copies).
Models are named as in make_models.py (which writes them) or given as paths; the targets (issue 46)
are marked met or missed where both servers ran.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_models import DEFAULT_FOLDER, EMBEDDED, resolve  # noqa: E402
from run_all import (cpu_description, free_port, llama_cpp_version, llama_server_binary,  # noqa: E402
                     llama_server_command, online_workloads, radixlm_serve_command, start_server, stop_server)

SYSTEMS = ("radixlm", "llama.cpp")
DEFAULT_MODELS = (EMBEDDED, "1b-q4_0", "8b-q4_0")
SAMPLE_S = 0.3
AFTER_S = 3.0  # sampled after the request
REQUEST_TOKENS = 8
# issue 46: peak at most 1.25x llama.cpp's, steady 1.15x, ready at most 4 s after it
PEAK_RATIO, STEADY_RATIO, READY_SLACK_S = 1.25, 1.15, 4.0


# ---- the process tree's PSS -------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Every descendant of pid (by each process's parent in /proc/*/stat)."""
    parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and parentheses
        parent.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parent.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


class Pss(NamedTuple):
    total: int  # bytes
    file: int  # of which pages of mapped files (the GGUF a server maps, its libraries)


def pss(pid: int) -> Pss:
    """The PSS of pid's process tree."""
    total = file = 0
    for p in [pid, *children(pid)]:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = dict(line.split()[:2] for line in f if line.startswith(("Pss:", "Pss_File:")))
        except OSError:  # exited meanwhile
            continue
        total += int(fields.get("Pss:", 0)) * 1024  # a zombie has no mappings
        file += int(fields.get("Pss_File:", 0)) * 1024
    return Pss(total, file)


def available() -> int:
    """The machine's MemAvailable, in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


class Sampler(threading.Thread):
    """The PSS of a process tree every SAMPLE_S seconds; `low` is set (and the caller stops the tree)
    once the machine's available memory falls under `floor` bytes."""

    def __init__(self, pid: int, floor: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.floor = pid, floor
        self.samples: list[tuple[float, Pss]] = []  # (monotonic time, the tree's PSS)
        self.low = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.monotonic(), pss(self.pid)))
            if available() < self.floor:
                self.low.set()
            self.done.wait(SAMPLE_S)

    def peak(self) -> int:
        return max(p.total for _, p in self.samples)

    def since(self, t: float) -> Pss:
        """The highest sample from time t on."""
        return max((p for s, p in self.samples if s >= t), key=lambda p: p.total)


# ---- one server ----------------------------------------------------------------------------------

@dataclass
class Run:
    model: str
    system: str
    command: str
    ready_s: float | None = None  # None: never ready
    peak_gb: float = 0.0
    after_gb: float | None = None
    after_file_gb: float | None = None  # of after_gb, mapped files' pages
    note: str = ""

    def cells(self) -> str:
        if self.ready_s is None:
            return self.note
        return (f"{self.ready_s:.1f} s / {self.peak_gb:.2f} GB / {self.after_gb:.2f} GB "
                f"({self.after_file_gb:.2f} GB of it mapped files)")


def warm(path: str) -> None:
    """Read the file once, so it starts from the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


LLAMA_SLOTS = max(w.concurrency for w in online_workloads(False))  # -np, as the online section starts it


def command(system: str, path: str, port: int, context: int, binary: str | None) -> list[str]:
    if system == "radixlm":
        return radixlm_serve_command(port, path, "--max-total-tokens", str(context))
    return llama_server_command(binary, path, port, LLAMA_SLOTS, context // LLAMA_SLOTS)


def measure(model: str, system: str, path: str, context: int, binary: str | None, floor_gb: float,
            timeout: float) -> Run:
    """Start the server, sample its tree until ready, send one request, sample AFTER_S more, stop it."""
    warm(path)
    port = free_port()
    argv = command(system, path, port, context, binary)
    run = Run(model, system, shlex.join(argv))
    start = time.monotonic()
    proc, log_path = start_server(f"memory-{system}", argv, port)
    sampler = Sampler(proc.pid, floor_gb * 1e9)
    sampler.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=None) as client:
            run.ready_s = wait_ready(client, proc, sampler, start, timeout)
            if run.ready_s is None:
                run.note = failure(proc, sampler, floor_gb, timeout, log_path)
                return run
            reply = client.post("/v1/completions", json={"model": "default", "prompt": "Hello, my name is",
                                                         "max_tokens": REQUEST_TOKENS, "temperature": 0,
                                                         "ignore_eos": True})
            if reply.status_code != 200:
                raise RuntimeError(f"{system} on {model}: the request failed: {reply.status_code} {reply.text[:300]}")
            answered = time.monotonic()
            time.sleep(AFTER_S)
            after = sampler.since(answered)
            run.after_gb, run.after_file_gb = after.total / 1e9, after.file / 1e9
            return run
    finally:
        sampler.done.set()
        sampler.join()
        stop_server(proc)
        run.peak_gb = sampler.peak() / 1e9


def wait_ready(client: httpx.Client, proc: subprocess.Popen, sampler: Sampler, start: float,
               timeout: float) -> float | None:
    """Seconds from start until /health first answered 200; None if the server exited, the machine
    ran low, or the timeout passed first."""
    while time.monotonic() < start + timeout and proc.poll() is None and not sampler.low.is_set():
        try:
            if client.get("/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return None


def failure(proc: subprocess.Popen, sampler: Sampler, floor_gb: float, timeout: float, log_path: str) -> str:
    peak = sampler.peak() / 1e9
    if sampler.low.is_set():
        return f"stopped at {peak:.1f} GB while loading (the machine had under {floor_gb:g} GB left)"
    if proc.poll() is not None:
        with open(log_path) as f:
            tail = f.read()[-300:].replace("\n", " ").replace("|", "/")
        return f"exited ({proc.returncode}) at {peak:.1f} GB: {tail}"
    return f"not ready in {timeout:.0f} s ({peak:.1f} GB)"


# ---- the table -------------------------------------------------------------------------------------

class Ratios(NamedTuple):
    late_s: float  # radixlm's ready time less llama.cpp's
    peak: float
    after: float


def ratios(runs: list[Run], model: str) -> Ratios | None:
    """radixlm against llama.cpp on one file, where both served it."""
    by = {r.system: r for r in runs if r.model == model}
    ours, theirs = by.get("radixlm"), by.get("llama.cpp")
    if not (ours and theirs and ours.ready_s is not None and theirs.ready_s is not None):
        return None
    return Ratios(ours.ready_s - theirs.ready_s, ours.peak_gb / theirs.peak_gb, ours.after_gb / theirs.after_gb)


def table(runs: list[Run], paths: dict[str, str]) -> list[str]:
    lines = ["| file | radixlm: ready / peak / after a request | llama.cpp: ready / peak / after | "
             "radixlm / llama.cpp: ready, peak, after |", "|---|---|---|---|"]
    for model, path in paths.items():
        ours, theirs = (next((r.cells() for r in runs if r.model == model and r.system == system), "not run")
                        for system in SYSTEMS)
        r = ratios(runs, model)
        versus = "-" if r is None else f"{r.late_s:+.1f} s, {r.peak:.2f}x, {r.after:.2f}x"
        lines.append(f"| {model}: {os.path.basename(path)}, {os.path.getsize(path) / 1e6:.0f} MB | {ours} | {theirs} | "
                     f"{versus} |")
    return lines


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def targets(runs: list[Run], paths: dict[str, str]) -> list[str]:
    """Issue 46's memory and start-up targets per file where both servers ran (missed where one of
    them could not serve it)."""
    out = []
    for model in paths:
        systems = {r.system: r for r in runs if r.model == model}
        if len(systems) < len(SYSTEMS):
            continue
        r = ratios(runs, model)
        if r is None:
            failed = " and ".join(s for s, run in systems.items() if run.ready_s is None)
            out.append(f"- {model}: missed: {failed} did not serve it")
            continue
        out.append(f"- {model}: peak {r.peak:.2f}x llama.cpp's (≤ {PEAK_RATIO}x): {met(r.peak <= PEAK_RATIO)}; after a "
                   f"request {r.after:.2f}x (≤ {STEADY_RATIO}x): {met(r.after <= STEADY_RATIO)}; ready {r.late_s:+.1f} s "
                   f"after it (≤ +{READY_SLACK_S:.0f} s): {met(r.late_s <= READY_SLACK_S)}")
    return ["Targets:", *out] if out else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated: {EMBEDDED!r} (the embedded file), make_models.py's names, or GGUF paths "
                         "(default: %(default)s)")
    ap.add_argument("--models-dir", default=DEFAULT_FOLDER, help="where make_models.py wrote them (default: %(default)s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--context", type=int, default=8192, help="KV tokens: radixlm's --max-total-tokens, llama-server's -c")
    ap.add_argument("--min-available-gb", type=float, default=3.0,
                    help="stop a server when the machine's available memory falls under this (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a server may take to be ready")
    ap.add_argument("--quick", action="store_true", help=f"{EMBEDDED} with radixlm alone")
    args = ap.parse_args()
    if args.quick:
        args.models, args.systems = EMBEDDED, "radixlm"
    systems = args.systems.split(",")
    if not systems or set(systems) - set(SYSTEMS):
        ap.error(f"systems are {', '.join(SYSTEMS)}; got {args.systems}")
    try:
        paths = {model: resolve(model, args.models_dir) for model in args.models.split(",")}
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    binary = llama_server_binary() if "llama.cpp" in systems else None
    if "llama.cpp" in systems and binary is None:
        ap.error("no llama-server binary: bash benchmarks/baselines/install_llama_cpp.sh builds one (or set $LLAMA_SERVER)")
    if "llama.cpp" in systems and args.context % LLAMA_SLOTS:
        ap.error(f"--context {args.context}: llama-server splits it among its {LLAMA_SLOTS} slots, so a multiple of them")

    load_before = os.getloadavg()[0]
    runs = []
    for model, path in paths.items():
        for system in systems:
            run = measure(model, system, path, args.context, binary, args.min_available_gb, args.timeout)
            print(f"{model} {system}: {run.cells()}", flush=True)
            runs.append(run)
    lines = ["", f"## Start-up and memory, {args.context} context tokens", "",
             f"`{shlex.join(['python', 'benchmarks/memory.py', *sys.argv[1:]])}`, load average {load_before:.1f} "
             f"before, {os.getloadavg()[0]:.1f} after.", f"CPU: {cpu_description()}, {os.cpu_count()} cores.",
             *([f"llama.cpp: {llama_cpp_version(binary)}."] if binary else []), "",
             "Each server alone, the file read once before its start (a warm page cache); ready: start to /health "
             f"answering 200; peak: the highest PSS of the process tree, sampled every {SAMPLE_S} s from the start "
             f"through one {REQUEST_TOKENS}-token completion; after a request: the highest over {AFTER_S:.0f} s after it.",
             "", *table(runs, paths), "", *targets(runs, paths), "", "Commands:",
             *[f"- {r.model}, {r.system}: `{r.command}`" for r in runs]]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
