"""schemathesis against the server's OpenAPI document: whatever it sends, no response is a 5xx and
none hangs, and the server ends the run with clean KV accounting."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from server.conftest import LiveServer, assert_kv_clean


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context bounds what one fuzzed request may generate, so a run stays quick
    # (behaviour alone: the default precision, where the exact-token tests pin --quantization none)
    srv = LiveServer("--quantization", "auto", "--context-length", "32", "--constraint-timeout", "10")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
# (15 cases an endpoint: 25 took 9 s more of CI's 25 minutes, for endpoints the concurrency fuzzer and
# each endpoint's own bad-input tests also cover)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx_or_hangs(case, fuzz_server):
    response = case.call(timeout=60)  # a hang fails here
    case.validate_response(response, checks=[not_a_server_error])


def test_after_the_fuzzing_the_server_is_healthy_and_leaks_nothing(fuzz_server):
    import httpx

    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    assert_kv_clean(fuzz_server.url)
