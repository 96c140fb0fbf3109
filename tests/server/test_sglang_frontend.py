"""SGLang's own frontend against `radixlm serve`: gen, select, regex, fork, multi-turn and
run_batch programs (tests/lang/sglang_programs.py) give, greedy, what the same programs give on
radixlm's language with only the import changed, and SGLang's documented native calls work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import radixlm
from server.conftest import assert_kv_clean

HERE = os.path.dirname(os.path.abspath(__file__))
LANG_TESTS = os.path.join(os.path.dirname(HERE), "lang")
sys.path.insert(0, LANG_TESTS)
from sglang_programs import NAMES, backend, programs  # noqa: E402


@pytest.fixture(scope="module")
def sglang_results(server):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([LANG_TESTS, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "sglang_frontend_client.py"), server.url],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def radixlm_results(server):
    b = backend(radixlm, server.url)
    yield {name: p.run(b) for name, p in programs(radixlm).items()}
    b.shutdown()


@pytest.mark.parametrize("name", NAMES)
def test_sglangs_frontend_gets_what_ours_gets(sglang_results, radixlm_results, name):
    assert sglang_results[name] == radixlm_results[name]


def test_the_programs_did_something(sglang_results):
    r = sglang_results
    assert r["select"]["city"] == "Paris" and len(r["fork"]["ideas"]) == 2
    assert all(r["run_batch"]["answers"]) and r["multi_turn"]["first"] and r["multi_turn"]["second"]


def test_sglang_streaming_and_native_calls(sglang_results, server):
    """The same 8 greedy tokens three ways: SGLang's `text_iter`, a /generate batch, and a stream
    read SGLang's way (each chunk everything so far)."""
    native = sglang_results["native"]
    assert len(sglang_results["text_iter"]) > 1 and len(native["streamed"]) > 1
    assert "".join(sglang_results["text_iter"]) == "".join(native["streamed"]) == native["batch"][0]
    assert native["batch"][0] != native["batch"][1]
    assert {"model_path", "max_total_tokens"} <= set(sglang_results["server_info"])
    assert_kv_clean(server.url)
