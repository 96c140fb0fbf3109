"""The language on a tiny random Llama with SmolLM2's tokenizer: the primitives do not depend on
the model being any good, and a program's gen is the raw generation of its text."""

from __future__ import annotations

import re

import pytest

import radixlm as rl
from conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smol_tokenizer):
    path = str(tmp_path_factory.mktemp("tiny-lang"))
    make_tiny_checkpoint("llama", path, vocab_size=len(smol_tokenizer))
    smol_tokenizer.save_pretrained(path)  # its chat template travels with it
    return path


@rl.function
def primitives(s, question):
    s += rl.user(question)
    s += rl.assistant(rl.gen("free", max_tokens=8))
    s += rl.user("Pick one.")
    s += rl.assistant(rl.select("pick", ["red", "green", "blue"]))
    s += rl.user("A number?")
    s += rl.assistant(rl.gen_int("number", max_tokens=6))
    s += rl.user("A code?")
    s += rl.assistant(rl.gen("code", regex=r"[A-Z]{2}-[0-9]{3}"))
    forks = s.fork(2)
    forks += rl.gen("branch", max_tokens=4)
    forks.join()
    s.set_var("branches", [f["branch"] for f in forks])


def test_primitives_on_a_tiny_random_model(tiny_path):
    from radixlm.runtime.local_engine import LocalEngine

    backend = rl.Runtime(tiny_path, max_total_tokens=8192)
    try:
        state = primitives.run(question="Hello?", backend=backend, temperature=0)
    finally:
        backend.shutdown()
    assert state["pick"] in ("red", "green", "blue")
    assert re.fullmatch(r"[-+]?[0-9]*", state["number"])  # an int literal, possibly cut by max_tokens
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", state["code"])
    assert state["branches"][0] == state["branches"][1]  # greedy: the branches agree
    raw = LocalEngine(tiny_path, max_total_tokens=8192)
    prompt = raw.apply_chat_template([{"role": "user", "content": "Hello?"}])
    expected = raw.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "stop": ["<|im_end|>"]})
    assert state["free"] == expected["text"]
