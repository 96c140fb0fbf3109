"""No request, and no pair of requests, takes the server down: the requests that once did, a
scheduler that sleeps while constraints compile, faults while building a batch, a device that is
gone, and n samples under one seed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import uuid

import httpx
import pytest

from server.conftest import LiveServer, assert_kv_clean

FAULTY = (os.path.join(os.path.dirname(__file__), "faulty_server.py"),)


def _generate(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def _serves_on(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    r = _generate(url, {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert_kv_clean(url)


@pytest.mark.parametrize("body,copies,fragment", [
    ({"text": "x", "sampling_params": {"max_new_tokens": 4, "n": 2, "regex": "(a|b)*a(a|b){40}"}}, 1, "took more than"),
    ({"text": "x", "sampling_params": {"regex": "(unclosed"}}, 2, "regex"),
    ({"text": "x", "sampling_params": {"n": 3, "json_schema": json.dumps({"$ref": "#/$defs/nowhere"})}}, 1,
     "Invalid reference"),
], ids=["n=2 explosive regex", "two clients, one bad regex", "n=3 unknown $ref"])
def test_the_requests_that_took_the_server_down_get_a_400(compile_limit_server, body, copies, fragment):
    server = compile_limit_server
    with concurrent.futures.ThreadPoolExecutor(copies) as pool:
        responses = list(pool.map(lambda _: _generate(server.url, body), range(copies)))
    for r in responses:
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"], r.text
    _serves_on(server.url)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _scheduler_pid(srv: LiveServer) -> int:
    for pid in srv.descendant_pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "radixlm-sched":
                    return pid
        except OSError:
            continue
    raise AssertionError("no radixlm-sched process")


def test_the_scheduler_sleeps_while_a_request_waits_on_its_constraint(compile_limit_server):
    """Before: an aborted request's finished compile was never collected, and from then on the
    scheduler spun a core whenever another request waited on a compile."""
    server = compile_limit_server
    tag = uuid.uuid4().hex[:8]  # constraints no earlier test compiled
    abandoned = {"text": "x", "rid": f"abandoned-{tag}", "sampling_params": {"regex": f"[a-z]{{1,200}}{tag}"}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_generate, server.url, abandoned)
        time.sleep(0.05)
        httpx.post(server.url + "/abort_request", json={"rid": abandoned["rid"]}, timeout=10)
        first.result()
        slow = pool.submit(_generate, server.url, {"text": "x", "sampling_params": {
            "max_new_tokens": 2, "regex": f"(a|b)*a(a|b){{40}}{tag}"}})  # compiles until the server's limit
        time.sleep(2.0)  # the abandoned compile has ended by now
        pid = _scheduler_pid(server)
        before = _cpu_seconds(pid)
        time.sleep(2.0)
        used = _cpu_seconds(pid) - before
        assert used < 0.2, f"the scheduler used {used:.2f} s of CPU in 2 s with nothing to run"
        r = slow.result()
    assert r.status_code == 400 and "took more than" in r.json()["error"]["message"], r.text
    _serves_on(server.url)


@pytest.mark.parametrize("api", ["native", "openai"])
def test_n_samples_under_one_seed_differ_and_reproduce(server, api):
    def sample() -> list[str]:
        if api == "native":
            r = _generate(server.url, {"text": "Name a colour and a fruit.", "sampling_params": {
                "n": 3, "seed": 11, "temperature": 1.0, "max_new_tokens": 16}})
            assert r.status_code == 200, r.text
            return [x["text"] for x in r.json()]
        r = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": "Name a colour and a fruit.",
                                                              "n": 3, "seed": 11, "max_tokens": 16}, timeout=120)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    first = sample()
    assert len(set(first)) == 3, f"n=3 with a seed gave {first}"
    assert sample() == first, "the same seed must give the same samples"
    if api == "native":  # sample 0 keeps the seed: it is the n=1 result
        one = _generate(server.url, {"text": "Name a colour and a fruit.", "sampling_params": {
            "seed": 11, "temperature": 1.0, "max_new_tokens": 16}})
        assert one.json()["text"] == first[0]


@pytest.fixture(scope="module")
def faulty_server():
    srv = LiveServer("--quantization", "auto", "--skip-tokenizer-init", launcher=FAULTY)  # behaviour: the default precision
    yield srv
    srv.stop()


def test_a_fault_while_building_a_batch_is_a_500_and_the_server_serves_on(faulty_server):
    from server.faulty_server import BUILD_FAULT_TOKEN

    url = faulty_server.url

    def generate(ids, n=4):
        return _generate(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, [1, 2, 3], 48)
        time.sleep(0.5)
        bad = [generate([1, 2, BUILD_FAULT_TOKEN, 5]) for _ in range(3)]
        assert running.result().status_code == 200 and running.result().json()["meta_info"]["completion_tokens"] == 48
    for r in bad:
        assert r.status_code == 500, r.text
        assert "building the batch" in r.json()["error"]["message"] and "error id" in r.json()["error"]["message"]
    assert generate([1, 2, 3, 5]).status_code == 200
    assert_kv_clean(url)
    assert "injected build fault" in faulty_server.output()


def test_a_device_that_is_gone_ends_the_server_with_a_clear_line():
    from server.faulty_server import DEVICE_FAULT_TOKEN

    srv = LiveServer("--skip-tokenizer-init", launcher=FAULTY)
    try:
        r = _generate(srv.url, {"input_ids": [1, 2, DEVICE_FAULT_TOKEN], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 500, r.text
        assert "device is unusable" in r.json()["error"]["message"]
        srv.proc.wait(timeout=20)  # it stops instead of answering 500 from now on
    finally:
        code = srv.stop()
    assert code == 1
    out = srv.output()
    assert "the scheduler exits so that the server stops" in out and "injected device fault" in out, out
