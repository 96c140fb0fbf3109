"""This machine's cores split between the processes that run the model (runtime/cores.py): disjoint
shares of whole physical cores, none empty, from the cores the starting process may use."""

from __future__ import annotations

import os

import pytest

from radixlm.runtime import cores
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.cores import cpu_shares, format_cpu_list, parse_cpu_list, physical_cores, split_cores


def own_core(cpu: int) -> tuple[int, int]:
    return 0, cpu


def smt(cores: int):
    """Two hyperthreads a core, numbered as Linux numbers them: CPU c and CPU c + cores share core c."""
    return lambda cpu: (0, cpu % cores)


def test_two_ranks_on_two_cores_get_one_each():
    assert split_cores([0, 1], 2, own_core) == [[0], [1]]
    assert [physical_cores(s, own_core) for s in split_cores([0, 1], 2, own_core)] == [1, 1]


def test_one_rank_takes_every_core():
    assert split_cores([0, 1, 2, 3], 1, own_core) == [[0, 1, 2, 3]]


def test_uneven_cores_give_the_extra_to_the_first_shares():
    assert split_cores(list(range(5)), 2, own_core) == [[0, 1, 2], [3, 4]]
    assert split_cores(list(range(7)), 3, own_core) == [[0, 1, 2], [3, 4], [5, 6]]


def test_more_processes_than_cores_share_cores_never_none():
    shares = split_cores([0, 1], 3, own_core)
    assert shares == [[0], [1], [0]]
    assert all(physical_cores(s, own_core) == 1 for s in shares)  # one thread each, never zero
    assert split_cores([5], 4, own_core) == [[5]] * 4


def test_a_restricted_parent_splits_only_its_cores():
    assert split_cores([2, 3, 6, 7], 2, own_core) == [[2, 3], [6, 7]]
    assert cpu_shares("auto", 2, allowed=[6, 2, 7, 3], core_of=own_core) == [[2, 3], [6, 7]]


def test_hyperthreads_of_a_core_stay_together():
    # 4 cores x 2 threads: CPUs 0-3 and their siblings 4-7
    shares = split_cores(list(range(8)), 2, smt(4))
    assert shares == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [physical_cores(s, smt(4)) for s in shares] == [2, 2]  # a torch thread per core, not per hyperthread
    # fewer cores than processes: hyperthreads apart, one each
    assert split_cores([0, 1], 2, smt(1)) == [[0], [1]]


def test_bind_none_pins_nothing_and_explicit_lists_are_kept():
    assert cpu_shares("none", 2, allowed=[0, 1], core_of=own_core) is None
    assert cpu_shares("0-1|2,3", 2, allowed=range(4), core_of=own_core) == [[0, 1], [2, 3]]
    assert cpu_shares("0-3", 2, allowed=range(8), core_of=own_core) == [[0, 1], [2, 3]]  # one list: split


def test_bad_binds_are_named():
    with pytest.raises(ValueError, match="3 core lists for 2 processes"):
        cpu_shares("0|1|2", 2, allowed=range(4), core_of=own_core)
    with pytest.raises(ValueError, match="may not use: 4-5 .it may use 0-3."):
        cpu_shares("0-1|4-5", 2, allowed=range(4), core_of=own_core)
    for bad in ("all", "0-", "3-1", "0,0", "1|x"):
        with pytest.raises(ValueError, match="--cpu-bind takes auto, none or core lists"):
            ServerArgs(cpu_bind=bad)
    with pytest.raises(ValueError, match="num_threads"):
        ServerArgs(num_threads=-1)


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpu_list([5]) == "5"


class _Replica:
    def terminate(self) -> None:
        pass

    def wait(self, timeout: float) -> int:
        return 0


@pytest.mark.parametrize("bind,replicas", [("auto", ["0-1", "2-3"]), ("0|2-3", ["0", "2-3"]), ("none", ["none"] * 2)])
def test_router_replicas_each_get_their_share(bind, replicas, monkeypatch):
    """`radixlm router --dp-size 2` starts each replica on its own cores (its `--cpu-bind` list, which
    its ranks split in turn)."""
    import uvicorn

    from radixlm.runtime import launch

    started = []
    monkeypatch.setattr(launch, "start_replica", lambda args: started.append(args) or ("http://127.0.0.1:1", _Replica()))
    monkeypatch.setattr(launch, "wait_until_serving", lambda url, proc: None)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cores, "machine_core", own_core)
    assert launch.run_router([], 2, ServerArgs(cpu_bind=bind), "round_robin", "127.0.0.1", 0) == 0
    assert [a.cpu_bind for a in started] == replicas
