"""Access control and request limits in front of every endpoint (the app alone: no runtime needed
for a refusal, so a stand-in client answers what gets through)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from radixlm.runtime.server.http_server import ServerState, create_app


class StandInClient:
    on_finish = None

    async def control(self, op: str) -> dict:
        if op == "flush_cache":
            raise KeyError("a bug")
        if op == "lora_adapters":  # (/v1/models lists them)
            return {"adapters": {}}
        return {"op": op}


def app(**options) -> TestClient:
    state = ServerState(StandInClient(), {"context_length": 2048}, {"page_size": 1}, "smol")
    return TestClient(create_app(state, **options))


def test_without_a_key_everything_is_open():
    client = app()
    assert client.get("/v1/models").status_code == 200
    assert client.get("/get_model_info").json() == {"op": "model_info"}


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic secret", "secret", "Bearer "])
def test_a_missing_or_wrong_key_gets_401(header):
    client = app(api_key="secret")
    headers = {"Authorization": header} if header is not None else {}
    for method, path in (("GET", "/v1/models"), ("GET", "/get_model_info"), ("POST", "/generate"),
                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("POST", "/update_weights_from_disk"),
                         ("GET", "/nowhere")):
        r = client.request(method, path, headers=headers, json={"text": "hi"} if method == "POST" else None)
        assert r.status_code == 401, (method, path, r.status_code)
        assert "API key" in r.json()["error"]["message"]


def test_the_right_key_passes_and_health_needs_none():
    client = app(api_key="secret")
    assert client.get("/health").status_code == 200
    r = client.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
    assert client.get("/get_model_info", headers={"authorization": "bearer secret"}).status_code == 200


def test_body_size_limit():
    client = app(max_request_bytes=1000)
    r = client.post("/generate", content=b'{"text": "' + b"x" * 2000 + b'"}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over the limit of 1000 bytes" in r.json()["error"]["message"]
    # under the limit it reaches the endpoint, which refuses the body for what it is (no runtime is asked)
    r = client.post("/generate", content=b"not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_a_body_over_the_limit_is_anthropics_request_too_large():
    """The Messages API's 413 has its own error type (it said invalid_request_error)."""
    import anthropic

    client = anthropic.Anthropic(base_url="http://testserver", api_key="unused", max_retries=0,
                                 http_client=app(max_request_bytes=1000))
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(model="smol", max_tokens=5, messages=[{"role": "user", "content": "x" * 2000}])
    assert caught.value.status_code == 413
    assert caught.value.body["error"]["type"] == "request_too_large", caught.value.body
    assert "over the limit of 1000 bytes" in caught.value.body["error"]["message"]


def test_a_body_without_a_length_gets_411():
    client = app()

    def chunks():
        yield b'{"text": "hi"}'

    r = client.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 411


def test_served_with_an_api_key_the_openai_client_needs_it():
    import openai

    from server.conftest import LiveServer

    srv = LiveServer("--api-key", "k3y-for-tests", "--max-request-bytes", "100000",
                     "--max-running-requests", "2", "--max-queued-requests", "1")
    try:
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="k3y-for-tests")
        out = good.completions.create(model="default", prompt="Hello", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong").models.list()
        # Anthropic's API takes the key as x-api-key too (its client sends either), and refuses in its own shape
        import anthropic

        ask = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}
        assert httpx.post(srv.url + "/v1/messages", json=ask, headers={"x-api-key": "k3y-for-tests"},
                          timeout=120).status_code == 200
        assert httpx.post(srv.url + "/v1/messages", json=ask, headers={"x-api-key": "wrong"}).status_code == 401

        said = anthropic.Anthropic(base_url=srv.url, api_key="k3y-for-tests", max_retries=0).messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "Hello"}])
        assert said.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.count_tokens(
                model="default", messages=[{"role": "user", "content": "Hello"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer k3y-for-tests"}
        info = httpx.get(srv.url + "/get_server_info", headers=auth).json()
        assert info["page_size"] >= 1 and "k3y-for-tests" not in str(info)  # the key is never echoed back
        too_big = httpx.post(srv.url + "/generate", content=b"x" * 200_000, headers=auth)
        assert too_big.status_code == 413

        # 2 running + 1 queued: of 6 requests sent at once, 3 are served and 3 told to retry
        # (all six arrive within milliseconds, far less than the first takes to finish; the timeout is
        # generous: with the other core busy, torch's threads made each request take up to ~100 s)
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, headers=auth, timeout=900) as c:
                body = {"text": "Count to a hundred:", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
                return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(6)))

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200] * 3 + [503] * 3, codes
        refused = next(r for r in asyncio.run(burst()) if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and "retry later" in refused.json()["error"]["message"]
        after = httpx.post(srv.url + "/generate", headers=auth, timeout=120,
                           json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}})
        assert after.status_code == 200  # the refused ones left nothing behind
    finally:
        assert srv.stop() == 0, srv.output()


def test_an_unexpected_error_is_a_500_with_an_id_in_the_log(caplog):
    r = TestClient(app().app, raise_server_exceptions=False).post("/flush_cache", content=b"")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    error_id = r.json()["error"]["message"].split("error id ")[1].rstrip(")")
    assert f"(error id {error_id})" in caplog.text and "a bug" in caplog.text


def test_the_page_needs_no_key_and_asks_for_it():
    client = app(api_key="secret")
    page = client.get("/")
    assert page.status_code == 200 and "<title>radixlm</title>" in page.text
    for path in ("/webui/app.js", "/webui/style.css"):
        assert client.get(path).status_code == 200, path
    assert app().get("/webui/%2E%2E/webui.py").status_code == 404  # only the page's own files
    assert client.get("/webui/../webui.py").status_code == 401  # (the path as resolved is not open)
    assert client.get("/v1/models").status_code == 401 and client.get("/debug/dashboard").status_code == 401
    assert "Bearer" in client.get("/webui/app.js").text  # the page sends the key it asked for


def test_the_page_serves_its_installed_libraries_and_nothing_else_of_node_modules():
    from radixlm.runtime.server.webui import installed_vendor_files

    client = app(api_key="secret")
    page = client.get("/").text
    for name in installed_vendor_files():  # (those npm ci installed: scripts/setup.sh)
        assert f"/webui/vendor/{name}" in page and client.get(f"/webui/vendor/{name}").status_code == 200, name
    assert "<!-- vendor -->" not in page
    for path in ("/webui/vendor/package.json", "/webui/vendor/marked/package.json", "/webui/vendor/node_modules",
                 "/webui/vendor/..%2Fpackage.json", "/webui/node_modules/marked/lib/marked.umd.js"):
        assert client.get(path).status_code == 404, path


def test_no_webui_serves_no_page():
    client = app(webui=False)
    assert client.get("/").status_code == 404 and client.get("/webui/app.js").status_code == 404
    assert app(api_key="secret", webui=False).get("/").status_code == 401  # nothing left open but /health
