"""The router's picture of each replica's cache, its routing key and its choice of replica."""

from __future__ import annotations

from radixlm.runtime.router.prefix_tree import PrefixTree
from radixlm.runtime.router.router import Router, routing_key


def test_prefix_tree_matches_splits_and_trims_least_recent_first():
    t = PrefixTree(max_chars=40)
    t.insert("system A: hello")
    t.insert("system A: bye")  # splits after "system A: "
    assert t.match("system A: hello there") == len("system A: hello")
    assert t.match("system A: b") == len("system A: b")
    assert t.match("other") == 0
    assert t.chars == len("system A: hello") + len("bye")
    t.match("system A: bye")  # "bye" is now more recent than "hello"
    t.insert("z" * 30)  # over 40 characters: least recently used leaves go until 30 remain
    assert t.chars <= 30 and t.match("z" * 30) == 30
    assert t.match("system A: hello") < len("system A: hello")


def test_routing_key_of_each_body_shape():
    assert routing_key("/generate", {"text": "abc"}) == "abc"
    assert routing_key("/generate", {"text": ["first", "second"]}) == "first"
    assert routing_key("/generate", {"input_ids": [1, 23]}) == "1,23,"
    assert routing_key("/generate", {"input_ids": [[4], [5]]}) == "4,"
    assert routing_key("/v1/completions", {"prompt": "p"}) == "p"
    chat = routing_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "s"},
                                                             {"role": "user", "content": "u"}]})
    assert chat.startswith("system\x00s\x00user")
    assert routing_key("/generate", {"text": 5}) == ""
    # Responses: the instructions first, so requests that share them share a replica
    one = routing_key("/v1/responses", {"instructions": "be brief", "input": "hi"})
    two = routing_key("/v1/responses", {"instructions": "be brief", "input": [{"role": "user", "content": "yo"}]})
    assert one == "be brief\x00hi" and two == "be brief\x00user\x00yo\x00"


def test_cache_aware_picks_the_replica_holding_the_prefix_unless_load_is_lopsided():
    router = Router(["http://a", "http://b"], balance_abs=4, balance_rel=1.5)
    a = router.pick("shared system prompt / user 1")
    b = router.pick("another system prompt / user 1")
    assert a is not b  # new prefixes spread over the replicas
    assert router.pick("shared system prompt / user 2") is a
    a.in_flight, b.in_flight = 10, 1  # a is swamped: the idle replica takes it despite the cache
    assert router.pick("shared system prompt / user 3") is b
    b.healthy = False
    assert router.pick("another system prompt / user 2") is a  # the only live one


def test_round_robin_alternates():
    router = Router(["http://a", "http://b"], policy="round_robin")
    assert [router.pick("same").url for _ in range(4)] == ["http://a", "http://b"] * 2


def test_the_router_takes_the_servers_api_key_and_body_limit():
    from fastapi.testclient import TestClient

    from radixlm.runtime.router.router import create_router_app

    client = TestClient(create_router_app(Router(["http://127.0.0.1:9"]), api_key="k", max_request_bytes=100))
    assert client.post("/generate", json={"text": "hi"}).status_code == 401
    authed = {"Authorization": "Bearer k"}
    assert client.post("/generate", content=b"x" * 200, headers=authed).status_code == 413
    assert client.get("/get_server_info", headers=authed).json()["policy"] == "cache_aware"
