"""`radixlm router` over two replicas of the tiny model: cache-aware routing beats round robin on
the prefix-cache hit rate, answers equal a replica's own, and a dead replica loses no request."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import httpx
import pytest

from helpers import MODULE_CWD
from server.conftest import LiveServer, free_port


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    servers = [LiveServer("--model-path", tiny_llama.path, "--skip-tokenizer-init") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def start_router(urls: list[str], policy: str) -> tuple[str, subprocess.Popen]:
    from radixlm.runtime.launch import wait_until_serving

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "router", "--worker-urls", *urls, "--policy", policy,
                             "--port", str(port)], cwd=MODULE_CWD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, proc, timeout=60)
    return url, proc


def shared_prefix_workload(groups: int = 8, per_group: int = 6) -> list[list[int]]:
    """Requests of `groups` groups, each group's sharing a 96-token head, in a random order (users
    of several conversations or system prompts arriving as they do)."""
    rng = random.Random(0)
    heads = [[rng.randrange(3, 500) for _ in range(96)] for _ in range(groups)]
    prompts = [heads[g] + [rng.randrange(3, 500) for _ in range(8)] for _ in range(per_group) for g in range(groups)]
    rng.shuffle(prompts)
    return prompts


def hit_rate(url: str, prompts: list[list[int]]) -> float:
    cached = total = 0
    for ids in prompts:
        r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
        cached += r.json()["meta_info"]["cached_tokens"]
        total += len(ids)
    return cached / total


def test_cache_aware_routing_beats_round_robin(replicas, capsys):
    prompts = shared_prefix_workload()
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        url, proc = start_router([s.url for s in replicas], policy)
        try:
            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            rates[policy] = hit_rate(url, prompts)
            info = httpx.get(url + "/get_server_info", timeout=10).json()
            assert all(r["served"] > 0 for r in info["replicas"]), info  # both replicas took work
        finally:
            proc.terminate()
            proc.wait(30)
    with capsys.disabled():
        print(f"\nprefix-cache hit rate over 2 replicas: round robin {rates['round_robin']:.1%}, "
              f"cache-aware {rates['cache_aware']:.1%}")
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


def test_answers_equal_a_replicas_own_and_streams_pass_through(replicas, tiny_llama, tmp_path):
    url, proc = start_router([s.url for s in replicas], "cache_aware")
    try:
        body = {"input_ids": tiny_llama.prompts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        direct = httpx.post(replicas[1].url + "/generate", json=body, timeout=60).json()
        routed = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert routed["output_ids"] == direct["output_ids"]
        with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2
        completion = httpx.post(url + "/v1/completions", json={
            "model": "default", "prompt": tiny_llama.prompts[0], "max_tokens": 8, "temperature": 0}, timeout=60)
        assert completion.status_code == 200, completion.text  # the OpenAI API passes through too
        assert completion.json()["usage"]["completion_tokens"] == 8
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert models
        one = httpx.get(url + f"/v1/models/{models[0]['id']}", timeout=10)  # answered by a replica
        assert one.status_code == 200 and one.json()["id"] == models[0]["id"], one.text
        bad = httpx.post(url + "/generate", content=b"{not json", timeout=30)
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        # a weight update reaches every replica (the same weights, under another path: both then name it)
        alias = str(tmp_path / "the-same-weights")
        os.symlink(tiny_llama.path, alias)
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": alias}, timeout=300)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert [httpx.get(s.url + "/get_model_info", timeout=10).json()["model_path"] for s in replicas] == [alias] * 2
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": alias + "-missing"}, timeout=60)
        assert r.status_code == 400 and "does not exist" in r.json()["message"], r.text
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_dead_replica_loses_no_request(tiny_llama):
    servers = [LiveServer("--model-path", tiny_llama.path, "--skip-tokenizer-init") for _ in range(2)]
    url, proc = start_router([s.url for s in servers], "round_robin")  # round robin: half would go to the dead one
    try:
        os.killpg(servers[0].proc.pid, signal.SIGKILL)
        servers[0].proc.wait()
        for ids in shared_prefix_workload(groups=4, per_group=3):
            r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
                           timeout=60)
            assert r.status_code == 200, r.text
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert [r["healthy"] for r in info["replicas"]] == [False, True]
    finally:
        proc.terminate()
        proc.wait(30)
        servers[1].stop()
