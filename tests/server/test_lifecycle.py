"""Start-up, shutdown and child death of the served process group: behaviour that needs no real
weights, on the tiny Qwen3 (a tokenizer, a chat template, random weights), except where a fault
token of SmolLM2's vocabulary is fed and what each process loads (the session's server)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from server.conftest import LiveServer, all_gone, assert_kv_clean


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_only_the_scheduler_loads_torch(server):
    """The HTTP server's process and the tokenizer process never import torch (seconds of each
    start, and their memory): only the scheduler, which runs the model, does."""
    names = {_name(pid): pid for pid in server.child_pids()}
    assert _maps_torch(names["radixlm-sched"])  # the check sees torch where it is loaded
    assert not _maps_torch(server.proc.pid), "the HTTP server's process loaded torch"
    assert not _maps_torch(names["radixlm-tok"]), "the tokenizer process loaded torch"


def test_sigterm_stops_everything_and_removes_sockets(tiny_qwen3):
    srv = LiveServer("--model-path", tiny_qwen3, "--skip-tokenizer-init", "--max-total-tokens", "64", "--page-size", "16")
    # (on the way: the tokenizer process checks prompts against the scheduler's pool, which it learns at start)
    r = httpx.post(srv.url + "/generate", json={"input_ids": [1] * 65, "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert r.status_code == 400 and "the prompt has 65 tokens; the KV cache pool holds 64" in r.text, r.text
    children = srv.child_pids()
    assert len(children) >= 2
    before = {d for d in os.listdir("/tmp") if d.startswith("radixlm-") and os.path.isdir(f"/tmp/{d}")}
    started = time.time()
    assert srv.stop(signal.SIGTERM) == 0, srv.output()
    assert time.time() - started < 15
    assert all_gone(children), "child processes outlived the server"
    after = {d for d in os.listdir("/tmp") if d.startswith("radixlm-") and os.path.isdir(f"/tmp/{d}")}
    assert not (after - before) and len(before - after) <= 1


@pytest.mark.parametrize("victim,comm", [("scheduler", "radixlm-sched"), ("tokenizer", "radixlm-tok")])
def test_kill_9_of_a_runtime_process_stops_the_server_and_a_restart_works(victim, comm, tiny_qwen3):
    srv = LiveServer("--model-path", tiny_qwen3)
    # a constraint starts the scheduler's compiler process: it must not outlive its parent either
    r = httpx.post(srv.url + "/generate", json={"text": "n:", "sampling_params": {"regex": "[0-9]{2}"}}, timeout=120)
    assert r.status_code == 200, r.text
    everyone = srv.descendant_pids()
    names = {pid: _name(pid) for pid in everyone}
    assert {"radixlm-sched", "radixlm-tok", "radixlm-grammar"} <= set(names.values()), names
    target = next(pid for pid, name in names.items() if name == comm)
    os.kill(target, signal.SIGKILL)
    started = time.time()
    while srv.proc.poll() is None and time.time() - started < 5:
        try:
            health = httpx.get(srv.url + "/health", timeout=1).status_code
            assert health in (200, 503)  # 200 only until the watchdog notices
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert srv.proc.poll() is not None, "the server outlived its dead child by 5 s"
    code = srv.stop()
    out = srv.output()
    assert code == 1 and "runtime process died" in out and f"{victim} process" in out, out
    assert all_gone(everyone), "processes outlived the server"
    again = LiveServer("--model-path", tiny_qwen3, "--skip-tokenizer-init", port=srv.port)  # the port is free again
    try:
        r = httpx.post(again.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                       timeout=60)
        assert r.status_code == 200
    finally:
        assert again.stop() == 0


def test_a_worker_fault_fails_its_request_with_an_id_and_the_server_serves_on():
    from server.faulty_server import FAULT_TOKEN

    srv = LiveServer("--skip-tokenizer-init", launcher=(os.path.join(os.path.dirname(__file__), "faulty_server.py"),))
    try:
        def generate(ids, n=4):
            return httpx.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": n, "temperature": 0}}, timeout=60)

        decoding = threading.Event()

        def stream_slow() -> tuple[int, int]:  # a request decoding meanwhile: its first token seen before the fault
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 48, "temperature": 0},
                    "stream": True}
            with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        decoding.set()
                        last = json.loads(line[len("data: "):])
            return r.status_code, last["meta_info"]["completion_tokens"]

        slow = concurrent.futures.ThreadPoolExecutor(1).submit(stream_slow)
        assert decoding.wait(60)
        r = generate([1, 2, FAULT_TOKEN, 5])
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error" and "error id" in message, message
        error_id = message.split("error id ")[1].rstrip(")")
        assert slow.result() == (200, 48)
        assert generate([1, 2, 3, 5]).status_code == 200
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert_kv_clean(srv.url)
    finally:
        assert srv.stop() == 0
    out = srv.output()
    assert error_id in out and "injected fault" in out, out  # the log holds the traceback under the id
