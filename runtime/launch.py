"""Start and stop the runtime's process group: the tokenizer process and the scheduler process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
from dataclasses import dataclass, field
from typing import Any

from runtime import ipc
from runtime.args import ServerArgs

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
    """Spawn the tokenizer and scheduler processes and wait until both are ready."""
    from runtime.scheduler.process import run_scheduler_process
    from runtime.tokenizer.manager import run_tokenizer_process

    ctx = mp.get_context("spawn")  # fork after torch or zmq initialised is unsafe
    ipc_dir = ipc.private_ipc_dir()
    client, to_sched, from_sched = (ipc.endpoint(ipc_dir, n) for n in ("clients", "to-scheduler", "from-scheduler"))
    pipes = {name: ctx.Pipe(duplex=False) for name in ("tokenizer", "scheduler")}
    targets = {
        "tokenizer": (run_tokenizer_process, (args, client, to_sched, from_sched, pipes["tokenizer"][1])),
        "scheduler": (run_scheduler_process, (args, to_sched, from_sched, pipes["scheduler"][1])),
    }
    procs = {}
    for name, (target, target_args) in targets.items():
        procs[name] = ctx.Process(target=target, args=target_args, name=f"radixlm-{name}", daemon=True)
        procs[name].start()
    group = RuntimeProcesses(client, ipc_dir, procs)
    try:
        for name, (reader, _) in pipes.items():
            report = _wait_ready(name, reader, procs[name], start_timeout)
            group.info.update({k: v for k, v in report.items() if k != "ok"})
    except BaseException:
        group.shutdown()
        raise
    log.info("runtime ready: %s", group.info)
    return group


def _wait_ready(name: str, reader: Any, proc: mp.process.BaseProcess, timeout: float) -> dict[str, Any]:
    waited = 0.0
    while not reader.poll(1.0):
        waited += 1.0
        if not proc.is_alive():
            raise LaunchError(f"the {name} process died while starting (exit code {proc.exitcode})")
        if waited >= timeout:
            raise LaunchError(f"the {name} process did not start within {timeout:.0f}s")
    report = reader.recv()
    if "error" in report:
        raise LaunchError(f"the {name} process failed to start: {report['error']}")
    return report

