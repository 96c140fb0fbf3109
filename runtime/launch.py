"""Start and stop the runtime's process group: the tokenizer process and the scheduler process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import shutil
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from radixlm.runtime import ipc
from radixlm.runtime.args import ServerArgs

log = logging.getLogger("radixlm.launch")


class LaunchError(RuntimeError):
    pass


@dataclass
class RuntimeProcesses:
    """A running process group and the address clients connect to."""

    client_address: str
    ipc_dir: str
    processes: dict[str, mp.process.BaseProcess]
    info: dict[str, Any] = field(default_factory=dict)  # what the scheduler reported when ready

    def dead_process(self) -> str | None:
        """The name and exit code of a child that stopped, if any."""
        for name, proc in self.processes.items():
            if not proc.is_alive():
                return f"{name} process (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

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
    """Spawn the tokenizer and scheduler processes (and this machine's other tensor-parallel ranks)
    and wait until all are ready. On a node other than 0, only its tensor-parallel ranks run."""
    from radixlm.runtime.scheduler.process import run_scheduler_process
    from radixlm.runtime.tokenizer.manager import run_tokenizer_process
    from radixlm.runtime.worker.tp_worker import run_follower

    ctx = mp.get_context("spawn")  # fork after torch or zmq initialised is unsafe
    if args.tp_size > 1 and not args.dist_init_addr:
        args = dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{free_port()}")
    ipc_dir = ipc.private_ipc_dir()
    client, to_sched, from_sched = (ipc.endpoint(ipc_dir, n) for n in ("clients", "to-scheduler", "from-scheduler"))
    followers = [rank for rank in args.local_ranks if rank > 0]
    names = (["tokenizer", "scheduler"] if args.node_rank == 0 else []) + [f"tp-rank-{r}" for r in followers]
    pipes = {name: ctx.Pipe(duplex=False) for name in names}
    targets = {f"tp-rank-{r}": (run_follower, (args, r, pipes[f"tp-rank-{r}"][1])) for r in followers}
    if args.node_rank == 0:
        targets["tokenizer"] = (run_tokenizer_process, (args, client, to_sched, from_sched, pipes["tokenizer"][1]))
        targets["scheduler"] = (run_scheduler_process, (args, to_sched, from_sched, pipes["scheduler"][1]))
    procs = {}
    with _children_skip_main():
        for name, (target, target_args) in targets.items():
            procs[name] = ctx.Process(target=target, args=target_args, name=f"radixlm-{name}", daemon=True)
            procs[name].start()
    group = RuntimeProcesses(client, ipc_dir, procs)
    try:
        for name, (reader, _) in pipes.items():
            report = _wait_ready(name, reader, procs[name], start_timeout, group)
            group.info.update({k: v for k, v in report.items() if k != "ok"})
    except BaseException:
        group.shutdown()
        raise
    log.info("runtime ready: %s", group.info)
    return group


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
    report = reader.recv()
    if "error" in report:
        raise LaunchError(f"the {name} process failed to start: {report['error']}")
    return report

