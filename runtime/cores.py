"""This machine's CPU cores split between the processes that run the model on it.

Tensor-parallel ranks on one machine (`--tp-size`; under `--nnodes`, this node's ranks) and the
replicas `radixlm router --dp-size` starts each get a disjoint share of the cores the starting
process may use (`os.sched_getaffinity`): each rank is pinned to its share and runs as many torch
threads as the share has physical cores (`--num-threads` overrides), as sgl-kernel's CPU backend
binds each rank's OpenMP threads to its own cores. Without it every rank runs a thread per core
of the whole machine: N ranks oversubscribe it N times, and their all-reduces wait on the slowest.

`--cpu-bind` says how: `auto` (the default: split the cores this process may use), `none` (no
pinning: each rank takes torch's default, every core), or core lists in SGLang's
SGLANG_CPU_OMP_THREADS_BIND form, `0-3|4-7`: one per process, or one list to split between them.
A replica gets its share as its own `--cpu-bind` list, which it splits between its ranks. Shares
are whole physical cores (a core's hyperthreads stay together), in the machine's numbering, so
neighbouring cores (one socket's) go together; with fewer physical cores than processes, single
logical CPUs; with fewer logical CPUs than processes, processes share CPUs round robin, one
thread each: never a share of no core. A rank pins itself only on a CPU device (on CUDA its
threads only feed the GPU; affinity stays as it was): `worker/parallel.place_rank`.

Leaf module, free of torch: the HTTP server's process and the router plan shares without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

CoreOf = Callable[[int], tuple[int, int]]  # a logical CPU -> its physical core (package id, core id)


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` -> [0, 1, 2, 3, 8, 10, 11] (Linux's cpulist form); ValueError naming what is wrong."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list (like 0-3,8): {part.strip()!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"{text!r} is not a CPU list (like 0-3,8): {part.strip()!r} is no range of CPUs")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"the CPU list {text!r} names a CPU twice")
    return cpus


def format_cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> `0-3,8`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_bind(bind: str) -> None:
    """A `--cpu-bind` value's form (its count is checked where the processes are known)."""
    if bind in ("auto", "none"):
        return
    try:
        for cpus in bind.split("|"):
            parse_cpu_list(cpus)
    except ValueError as e:
        raise ValueError(f"--cpu-bind takes auto, none or core lists like 0-3|4-7: {e}") from None


def cpu_shares(bind: str, count: int, allowed: Sequence[int] | None = None,
               core_of: CoreOf | None = None) -> list[list[int]] | None:
    """Each of `count` processes' cores under `--cpu-bind` `bind`, or None (`none`: no pinning).
    `allowed`: the cores this process may use (default: its affinity); `core_of`: each CPU's
    physical core (default: the machine's topology)."""
    allowed = sorted(os.sched_getaffinity(0)) if allowed is None else sorted(allowed)
    core_of = core_of or machine_core
    if bind == "none":
        return None
    if bind == "auto":
        return split_cores(allowed, count, core_of)
    lists = [parse_cpu_list(cpus) for cpus in bind.split("|")]
    outside = sorted(set().union(*lists) - set(allowed))
    if outside:
        raise ValueError(f"--cpu-bind {bind} names CPUs this process may not use: {format_cpu_list(outside)} "
                         f"(it may use {format_cpu_list(allowed)})")
    if len(lists) == 1:
        return split_cores(lists[0], count, core_of)
    if len(lists) != count:
        raise ValueError(f"--cpu-bind {bind} gives {len(lists)} core lists for {count} processes: give one "
                         "per process, or one list to split between them")
    return lists


def split_cores(cpus: Sequence[int], count: int, core_of: CoreOf) -> list[list[int]]:
    """`cpus` in `count` disjoint shares, as even as can be (earlier shares take the extra: rank 0
    also runs the scheduler): whole physical cores while there are at least `count` of them, else
    single CPUs; with fewer CPUs than `count`, CPUs shared round robin (never an empty share)."""
    if count < 1 or not cpus:
        raise ValueError(f"cannot split {len(cpus)} CPUs between {count} processes")
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core_of(cpu), []).append(cpu)
    units = sorted(cores.values()) if len(cores) >= count else [[cpu] for cpu in sorted(cpus)]
    if len(units) < count:
        return [units[i % len(units)] for i in range(count)]
    per, extra = divmod(len(units), count)
    shares, start = [], 0
    for i in range(count):
        end = start + per + (i < extra)
        shares.append(sorted(cpu for unit in units[start:end] for cpu in unit))
        start = end
    return shares


def physical_cores(cpus: Sequence[int], core_of: CoreOf | None = None) -> int:
    """How many physical cores `cpus` span: the torch threads a process pinned to them runs."""
    core_of = core_of or machine_core
    return len({core_of(cpu) for cpu in cpus})


def machine_core(cpu: int) -> tuple[int, int]:
    """The physical core (package id, core id) of logical CPU `cpu`, from Linux's topology; a core
    of its own where that cannot be read."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as p, open(f"{topology}/core_id") as c:
            return int(p.read()), int(c.read())
    except (OSError, ValueError):
        return -1, cpu


def pin(cpus: Sequence[int]) -> None:
    """Pin every thread of this process (those made later inherit it) to `cpus`; nothing where
    the platform has no affinity call."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
