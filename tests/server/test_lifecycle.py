"""Start-up, shutdown and child death of the served process group."""

from __future__ import annotations

import os
import signal
import time

import httpx

from server.conftest import LiveServer


def _gone(pids, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_sigterm_stops_everything_and_removes_sockets():
    srv = LiveServer("--skip-tokenizer-init")
    children = srv.child_pids()
    assert len(children) >= 2
    before = {d for d in os.listdir("/tmp") if d.startswith("radixlm-") and os.path.isdir(f"/tmp/{d}")}
    started = time.time()
    assert srv.stop(signal.SIGTERM) == 0, srv.output()
    assert time.time() - started < 15
    assert _gone(children), "child processes outlived the server"
    after = {d for d in os.listdir("/tmp") if d.startswith("radixlm-") and os.path.isdir(f"/tmp/{d}")}
    assert not (after - before) and len(before - after) <= 1


def test_dead_child_stops_the_server_with_a_named_error():
    srv = LiveServer("--skip-tokenizer-init")
    children = srv.child_pids()
    os.kill(children[-1], signal.SIGKILL)  # one of the two runtime processes
    deadline = time.time() + 10
    while srv.proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    code = srv.stop()
    assert code == 1, srv.output()
    out = srv.output()
    assert "runtime process died" in out and ("scheduler process" in out or "tokenizer process" in out), out
    assert _gone(children)
    try:
        httpx.get(srv.url + "/health", timeout=2)
        raise AssertionError("server still answering")
    except httpx.HTTPError:
        pass
