"""Every example in examples/ runs against the live server and does what it says."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

import radixlm as rl
from server.conftest import ROOT, assert_kv_clean

EXAMPLES = os.path.join(ROOT, "examples")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def endpoint(server):
    backend = rl.RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


def test_few_shot_qa(endpoint):
    ex = load("few_shot_qa")
    for row, (_, options) in zip(ex.main(endpoint), ex.QUESTIONS):
        assert row["answer"] == options[row["scores"].index(max(row["scores"]))]


def test_json_extraction(endpoint):
    ex = load("json_extraction")
    for out in ex.main(endpoint):
        jsonschema.validate(out["record"], ex.SCHEMA)
        assert re.fullmatch(ex.DATE, out["date"])


def test_chat_session_reuses_the_history(endpoint):
    rows = load("chat_session").main(endpoint)
    for before, after in zip(rows, rows[1:]):
        assert after["cached_tokens"] >= before["prompt_tokens"]


def test_multi_turn_agent_runs_tools_between_generations(endpoint, server):
    ex = load("multi_turn_agent")
    out = ex.main(endpoint)
    assert out["trace"] and {s["question"] for s in out["trace"]} == set(ex.QUESTIONS)
    for step in out["trace"]:
        assert re.fullmatch(ex.ARGUMENT[step["action"]], step["argument"])
        if step["action"] != "finish":
            assert step["observation"] == ex.TOOLS[step["action"]](step["argument"])
    assert out["turns"] == len(ex.QUESTIONS)
    assert out["cached_tokens"] > 200  # the last step resumed from the whole conversation in the cache
    assert ex.calculator("2 * (3 + 4)") == "14" and ex.calculator("__import__('os')").startswith("error")
    assert_kv_clean(server.url)


def test_tree_of_thought(endpoint):
    out = load("tree_of_thought").main(endpoint)
    assert len(out["levels"]) == 2
    for level in out["levels"]:
        assert len(level["candidates"]) == 3 and 0 <= level["best"] < 3
        assert all(re.fullmatch(r"[A-Z0-9][^\n]{4,100}", c) or len(c) < 6 for c in level["candidates"])
    assert out["answer"]


def test_an_example_runs_as_a_script(server):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "json_extraction.py"), "--url", server.url],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert json.loads(first.split("} ")[0].replace("'", '"') + "}")["age"] == 34


def test_openai_tools_runs_the_calls_the_model_asks_for(server):
    ex = load("openai_tools")
    out = ex.main(server.url + "/v1")
    assert out["calls"], out
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in ex.TOOLS}
    for call in out["calls"]:
        jsonschema.validate(call["arguments"], tools[call["name"]])
        assert call["result"] == ex.FUNCTIONS[call["name"]](**call["arguments"])
    first, last = out["usages"][0], out["usages"][-1]
    assert last.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 1  # each turn resumes the last
    assert_kv_clean(server.url)
