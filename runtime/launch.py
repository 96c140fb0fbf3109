"""Every process the runtime starts, and how: the one place.

Parent side: `start_processes` spawns the process group (the tokenizer process, the scheduler
process, this machine's tensor-parallel followers), `RuntimeProcesses.wait_ready` waits until
each reports ready (`launch_processes`: both); `serve` (`radixlm serve`) runs that group with
the HTTP server in front, which is only a client of it; `run_router` (`radixlm router`) starts replica servers and the router in front of them.
Child side: `run_child` is every child's entry point (SIGINT left to the parent, killed with
the parent, logging, its start-up object built, readiness or the start-up error reported, then
its loop). A child's start-up object is a class with `ready_info()` and `run_forever()`:
`SchedulerProcess`, `TokenizerManager`, `Follower`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib
import logging
import multiprocessing as mp
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Iterator

from radixlm.runtime import cores, ipc
from radixlm.runtime.args import ServerArgs

log = logging.getLogger("radixlm.launch")

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


class LaunchError(RuntimeError):
    pass


@dataclass
class RuntimeProcesses:
    """A running process group and the address clients connect to."""

    client_address: str
    ipc_dir: str
    processes: dict[str, mp.process.BaseProcess]
    info: dict[str, Any] = field(default_factory=dict)  # what the children reported when ready
    starting: dict[str, Connection] = field(default_factory=dict)  # children yet to report: their pipes

    def dead_process(self) -> str | None:
        """The name and exit code of a child that stopped, if any."""
        for name, proc in self.processes.items():
            if not proc.is_alive():
                return f"{name} process (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until every child reported that it is ready; on any failure stop them all and raise."""
        try:
            for name, reader in list(self.starting.items()):
                report = _wait_ready(name, reader, self.processes[name], timeout, self)
                if "placement" in report:  # a rank's cores and threads, by process
                    self.info.setdefault("placement", {})[name] = report.pop("placement")
                self.info.update({k: v for k, v in report.items() if k != "ok"})
                del self.starting[name]
        except BaseException:
            self.shutdown()
            raise
        log.info("runtime ready: %s", self.info)

    def shutdown(self, timeout: float = 5.0) -> None:
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes.values():
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_processes(args: ServerArgs, start_timeout: float = 600.0) -> RuntimeProcesses:
    """Spawn the process group (`start_processes`) and wait until all are ready."""
    group = start_processes(args)
    group.wait_ready(start_timeout)
    return group


def start_processes(args: ServerArgs) -> RuntimeProcesses:
    """Spawn the tokenizer and scheduler processes (and this machine's other tensor-parallel ranks)
    without waiting for them (`RuntimeProcesses.wait_ready`). On a node other than 0, only its
    tensor-parallel ranks run. Each child's start-up class is named, not imported, here: the
    parent (the HTTP server's process) never imports the scheduler's and workers' modules, nor so
    torch, and the children start before it imports anything more."""
    ctx = mp.get_context("spawn")  # fork after torch or zmq initialised is unsafe
    if args.tp_size > 1 and not args.dist_init_addr:
        args = dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{free_port()}")
    shares = cores.cpu_shares(args.cpu_bind, len(args.local_ranks))  # this machine's ranks split its cores
    cpus = {rank: shares[i] if shares else None for i, rank in enumerate(args.local_ranks)}
    ipc_dir = ipc.private_ipc_dir()
    client, to_sched, from_sched = (ipc.endpoint(ipc_dir, n) for n in ("clients", "to-scheduler", "from-scheduler"))
    # name -> (process title, start-up class as "module:Class", its arguments)
    children: dict[str, tuple[str, str, tuple]] = {}
    if args.node_rank == 0:
        children["tokenizer"] = ("radixlm-tok", "radixlm.runtime.tokenizer.manager:TokenizerManager",
                                 (args, client, to_sched, from_sched))
        children["scheduler"] = ("radixlm-sched", "radixlm.runtime.scheduler.process:SchedulerProcess",
                                 (args, to_sched, from_sched, cpus[0]))
    for r in args.local_ranks:
        if r > 0:
            children[f"tp-rank-{r}"] = (f"radixlm-tp{r}", "radixlm.runtime.worker.tp_worker:Follower", (args, r, cpus[r]))
    procs, pipes = {}, {}
    with _children_skip_main():
        for name, (title, target, target_args) in children.items():
            reader, writer = ctx.Pipe(duplex=False)
            procs[name] = ctx.Process(target=run_child, args=(title, target, target_args, writer),
                                      name=f"radixlm-{name}", daemon=True)
            procs[name].start()
            writer.close()  # the child's copy is its own: a child gone before it reports leaves the pipe at EOF
            pipes[name] = reader
    return RuntimeProcesses(client, ipc_dir, procs, starting=pipes)


def run_child(title: str, target: str, target_args: tuple, ready: Connection) -> None:
    """A runtime child's entry point: import the class `target` names ("module:Class"), build it
    with `target_args` and report on `ready` that it is ready (with its `ready_info()`) or why it
    failed to start, then run its loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    ipc.die_with_parent(title)
    configure_logging()
    try:
        module, _, name = target.partition(":")
        child = getattr(importlib.import_module(module), name)(*target_args)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        log.exception("%s failed to start", title)
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    # What start-up built (the model, the tokenizer, the libraries' modules) lives as long as the
    # process: frozen out of the collector's generations, a full collection while serving walks
    # only what serving made, not the hundreds of thousands of objects start-up left. What it
    # freed (the weights a quantized model was made from) goes back to the system.
    gc.collect()
    trim_heap()
    gc.freeze()
    ready.send({"ok": True, **child.ready_info()})
    child.run_forever()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere).
    Freed tensors' memory otherwise stays resident in the allocator: after loading a model (the
    fp32 weights a quantized model was made from) that was ~440 MB of a SmolLM2 server's 1.7 GB."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


@contextlib.contextmanager
def _children_skip_main() -> Iterator[None]:
    """While processes start: a spawned child re-runs the parent's main script (or `-m` module)
    before its target, so a plain script that makes an Engine at top level, with no
    `if __name__ == "__main__":`, would start another Engine in every child. Every target here
    lives in runtime's own modules, so the children are told there is no main to re-run
    (multiprocessing reads `__spec__` and `__file__` of `__main__` when a process starts). A
    program that wants its children to run it first (one that patches the runtime as it is
    imported: the tests' fault injector) says so with `RADIXLM_CHILDREN_RUN_MAIN = True`."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "RADIXLM_CHILDREN_RUN_MAIN", False):
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def free_port() -> int:
    """A TCP port free on this machine now (for a server or a rendezvous about to bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(name: str, reader: Any, proc: mp.process.BaseProcess, timeout: float,
                group: RuntimeProcesses) -> dict[str, Any]:
    waited = 0.0
    while not reader.poll(1.0):
        waited += 1.0
        dead = group.dead_process()  # tensor-parallel ranks wait on each other: any death ends the start
        if dead:
            raise LaunchError(f"the {dead} while starting")
        if waited >= timeout:
            raise LaunchError(f"the {name} process did not start within {timeout:.0f}s")
    try:
        report = reader.recv()
    except EOFError:  # gone without a word
        proc.join(timeout)
        raise LaunchError(f"the {name} process (pid {proc.pid}) exited with code {proc.exitcode} while starting") from None
    if "error" in report:
        raise LaunchError(f"the {name} process failed to start: {report['error']}")
    return report


# ---- `radixlm serve`: the process group with the HTTP server in front -----------------------

def serve(args: ServerArgs, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          max_request_bytes: int | None = None, max_queued_requests: int | None = None, webui: bool = True) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until a runtime process dies (exit 1). `webui`: the
    page at `/` (server/webui.py)."""
    configure_logging()
    group = start_processes(args)
    if args.node_rank > 0:
        group.wait_ready()
        return _serve_ranks(args, group)
    try:
        # the HTTP server's modules load while the children start
        import asyncio
        import threading

        import uvicorn

        from radixlm.runtime.client import RuntimeClient
        from radixlm.runtime.model_config import resolve_model
        from radixlm.runtime.server.http_server import MAX_REQUEST_BYTES, ServerState, create_app

        group.wait_ready()
        model_name = args.served_name(resolve_model(args.model_path))
        info = {**group.info, "client_address": group.client_address}  # for local clients that attach (ZeroMQ)
        client = RuntimeClient(group.client_address)
        if max_queued_requests is not None:
            client.max_in_flight = args.max_running_requests + max_queued_requests
        state = ServerState(client, info, dataclasses.asdict(args), model_name)
        app = create_app(state, api_key, max_request_bytes or MAX_REQUEST_BYTES, webui)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)
        server = uvicorn.Server(config)

        def watchdog() -> None:
            announced = False
            while not server.should_exit:
                if server.started and not announced:
                    announced = True
                    page = f"; the page at http://{host}:{port}/" if webui else ""
                    print(f"radixlm ready on http://{host}:{port} ({group.info.get('architecture')}, "
                          f"{group.info.get('max_total_tokens')} KV tokens{page})", flush=True)
                dead = group.dead_process()
                if dead:
                    log.error("runtime process died: %s; shutting down", dead)
                    state.dead = dead
                    server.should_exit = True
                    return
                time.sleep(0.2)

        threading.Thread(target=watchdog, name="radixlm-watchdog", daemon=True).start()
        # uvicorn re-raises the signal that stopped it; turn that into a normal exit so the
        # children are stopped below
        signal.signal(signal.SIGTERM, _exit_quietly)
        try:
            asyncio.run(server.serve())
        except KeyboardInterrupt:
            pass
        return 1 if state.dead else 0
    finally:
        group.shutdown()


def _serve_ranks(args: ServerArgs, group: RuntimeProcesses) -> int:
    """A node other than 0: its tensor-parallel ranks follow node 0's scheduler; no API here. Runs
    until SIGINT/SIGTERM (exit 0) or until a rank stops, e.g. because node 0 went away (exit 1)."""
    ranks = args.local_ranks
    print(f"radixlm node {args.node_rank}: tensor-parallel ranks {ranks.start}-{ranks.stop - 1} joined "
          f"{args.dist_init_addr}", flush=True)
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        while (dead := group.dead_process()) is None:
            time.sleep(0.2)
        log.error("runtime process died: %s; shutting down", dead)
        return 1
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        group.shutdown()


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


# ---- servers in their own processes: `radixlm router`'s replicas, scripts and tests --------

def start_replica(args: ServerArgs) -> tuple[str, subprocess.Popen]:
    """A `radixlm serve` on a free local port with these options; (its URL, its process). Its
    `--cpu-bind` names the cores its ranks split (`run_router` gives each replica its share)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "serve", "--port", str(port), *args.to_cli_args()])
    return f"http://127.0.0.1:{port}", proc


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Block until the server `proc` started answers /health at `url`; raises RuntimeError if it
    exits first or does not answer within `timeout` seconds (for scripts and tests that start one)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a connection refused costs microseconds: poll often, never a long nap
    raise RuntimeError(f"the server did not answer within {timeout:.0f}s")


def run_router(urls: list[str], dp_size: int, args: ServerArgs, policy: str, host: str, port: int,
               api_key: str | None = None) -> int:
    """`radixlm router`: start `dp_size` replicas with these options, then route over them and `urls`."""
    import uvicorn

    from radixlm.runtime.router.router import Router, create_router_app

    configure_logging()
    shares = cores.cpu_shares(args.cpu_bind, dp_size) if dp_size else None  # the replicas split this machine's cores
    replicas = [start_replica(dataclasses.replace(args, cpu_bind=cores.format_cpu_list(shares[i]) if shares else "none"))
                for i in range(dp_size)]
    try:
        for url, proc in replicas:
            wait_until_serving(url, proc)
        router = Router(list(urls) + [url for url, _ in replicas], policy)
        print(f"radixlm router on http://{host}:{port} over {len(router.replicas)} replicas ({policy})", flush=True)
        uvicorn.run(create_router_app(router, api_key), host=host, port=port, log_level="warning")
        return 0
    finally:
        for _, proc in replicas:
            proc.terminate()
        for _, proc in replicas:
            proc.wait(30)
