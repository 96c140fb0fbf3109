"""`GET /debug/dashboard`: the live view's numbers, checked against the server's own accounting and
against what the requests sent must have left in the radix tree."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx

from server.conftest import assert_kv_clean

SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about bread, opening hours "
          "and prices in one short sentence, and never invent a price that is not on the menu. ")


def _get(server, path: str) -> dict:
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _generate(server, body: dict) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _nodes(tree: dict):
    yield tree
    for child in tree["children"]:
        yield from _nodes(child)


def test_idle_dashboard_equals_the_kv_accounting(server):
    _generate(server, {"text": "warm the cache with something", "sampling_params": {"max_new_tokens": 4}})
    assert_kv_clean(server.url)
    view, acct = _get(server, "/debug/dashboard"), _get(server, "/debug/kv_accounting")
    for key in ("free_pages", "evictable_pages", "locked_pages", "pool_pages"):
        assert view[key] == acct[key], (key, view, acct)
    assert view["request_pages"] == 0 and view["running_requests"] == 0 and view["waiting_requests"] == 0
    assert view["free_pages"] + view["evictable_pages"] == view["pool_pages"]
    tree = view["tree"]
    # every cached page is in the tree: the snapshot's token total is the evictable pages' tokens
    assert tree["subtree_tokens"] == view["evictable_pages"] * view["page_size"]
    assert 0.0 <= view["cache_hit_rate"] <= 1.0


def test_the_tree_shows_a_shared_system_prompt(server):
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    params = {"max_new_tokens": 3, "temperature": 0}
    first = _generate(server, {"text": SYSTEM + "When do you open?", "sampling_params": params})
    second = _generate(server, {"text": SYSTEM + "How much is a baguette?", "sampling_params": params})
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] > 20
    tree = _get(server, "/debug/dashboard")["tree"]
    # the shared part is one node at the top holding both requests' tails below it
    (shared,) = tree["children"]
    assert shared["tokens"] == second["meta_info"]["cached_tokens"]
    assert len(shared["children"]) == 2 and shared["locks"] == 0
    assert shared["head_text"] and SYSTEM.startswith(shared["head_text"])
    for node in _nodes(shared):
        assert node["depth"] >= shared["tokens"] and node["subtree_tokens"] >= node["tokens"]
    assert tree["subtree_tokens"] == sum(n["tokens"] for n in _nodes(tree))


def test_a_running_request_shows_in_the_queues_the_step_and_the_pages(server):
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_generate, server, {"text": "count slowly", "rid": "dash-long",
                                              "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
        deadline, view = time.time() + 60, {}
        while time.time() < deadline:
            view = _get(server, "/debug/dashboard")
            # the first step seen may still be the request's prefill: wait for one of its decodes
            if view["running_requests"] == 1 and (view["last_step"] or {}).get("decode_rows"):
                break
            time.sleep(0.2)
        httpx.post(server.url + "/abort_request", json={"rid": "dash-long"}, timeout=30)
        fut.result(timeout=60)
    assert view["running_requests"] == 1, view
    assert view["tokens_per_s"] > 0 and view["steps_per_s"] > 0
    last = view["last_step"]
    assert last["decode_rows"] == 1 and last["sampled"] == 1 and last["prefill_rows"] == 0
    assert last["seconds_ago"] < 5
    assert view["request_pages"] + view["locked_pages"] > 0  # the running request's KV
    assert view["free_pages"] + view["evictable_pages"] + view["locked_pages"] + view["request_pages"] == view["pool_pages"]
    assert_kv_clean(server.url)
