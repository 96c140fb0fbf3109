"""`Engine`: the Python API over a background process group."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from radixlm.runtime.client import RequestFailed
from radixlm.runtime.engine import Engine
from radixlm.runtime.native import BadRequest


@pytest.fixture(scope="module")
def engine():
    eng = Engine(max_total_tokens=20000, quantization="none")
    yield eng
    eng.shutdown()


def test_engine_equals_local_engine(engine, smol):
    prompts = [smol.engine.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a fruit.")]
    params = {"max_new_tokens": 16, "temperature": 0}
    remote = engine.generate(prompts, params)
    local = smol.engine.generate(prompts, params)
    assert [r["output_ids"] for r in remote] == [r["output_ids"] for r in local]
    assert engine.generate(prompts[0], params)["text"] == local[0]["text"]
    chat = engine.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    assert chat["text"] == local[0]["text"]


def test_engine_batches_calls_from_many_threads(engine):
    params = {"max_new_tokens": 8, "temperature": 0}
    expected = engine.generate([f"Count: {i}," for i in range(8)], params)
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: engine.generate(f"Count: {i},", params), range(8)))
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    acct = engine.check_accounting()
    assert acct["ok"] and acct["locked_pages"] == 0


def test_engine_streams_the_same_result_piece_by_piece(engine):
    params = {"max_new_tokens": 20, "temperature": 0}
    whole = engine.generate("Once upon a time", params)
    chunks = list(engine.stream("Once upon a time", params))
    assert len(chunks) > 1 and "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert engine.model_info()["chat_template"]


def test_sglang_engine_calls(engine):
    """SGLang's `Engine.generate` arguments and its streaming shape (each chunk everything so far)."""
    params = {"max_new_tokens": 12, "temperature": 0}
    whole = engine.generate("Once upon a time", params, rid="mine", lora_path=None, image_data=None,
                            custom_logit_processor=None, return_hidden_states=False)
    assert whole["meta_info"]["id"] == "mine"
    chunks = list(engine.generate("Once upon a time", params, stream=True))
    assert len(chunks) > 1 and chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    both = engine.generate(["Alpha beta gamma delta", "Epsilon zeta"], params, return_logprob=[True, False],
                           logprob_start_len=[0, None])
    first = both[0]["meta_info"]
    assert len(first["input_token_logprobs"]) == first["prompt_tokens"] and first["input_token_logprobs"][0][0] is None
    assert len(first["output_token_logprobs"]) == 12 and "output_token_logprobs" not in both[1]["meta_info"]
    with pytest.raises(BadRequest, match="'image_data' is not supported"):
        engine.generate("hi", params, image_data="cat.png")
    with pytest.raises(RequestFailed, match="unknown LoRA adapter 'adapter' \\(served: none\\)") as failed:
        engine.generate("hi", params, lora_path="adapter")  # (a served one is named as SGLang names it)
    assert failed.value.status == 400
    with pytest.raises(BadRequest, match="unknown field"):
        engine.generate("hi", params, no_such_option=1)


def test_leaving_a_stream_early_ends_its_request_and_frees_its_kv(engine):
    early = engine.stream("Write a long story.", {"max_new_tokens": 2000, "ignore_eos": True})
    rid = next(early)["meta_info"]["id"]
    acct = engine.check_accounting()
    assert rid in [r["rid"] for r in acct["live"]] and acct["locked_pages"] > 0, acct
    early.close()  # leaving early aborts the request
    deadline = time.time() + 5
    while (rid in [r["rid"] for r in acct["live"]] or acct["locked_pages"]) and time.time() < deadline:
        time.sleep(0.05)
        acct = engine.check_accounting()
    assert acct["ok"] and acct["idle"] and acct["live"] == [] and acct["locked_pages"] == 0, acct
    assert acct["free_pages"] + acct["evictable_pages"] == acct["pool_pages"], acct


def test_engine_errors_are_value_errors(engine):
    with pytest.raises(RequestFailed, match="top_p"):
        engine.generate("hi", {"top_p": 7})
    with pytest.raises(BadRequest, match="exactly one"):
        engine.generate()
    assert engine.generate("still fine", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_shutdown_is_idempotent():
    eng = Engine(max_total_tokens=4096, skip_tokenizer_init=True)
    procs = list(eng._group.processes.values())
    assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
    eng.shutdown()
    eng.shutdown()
    assert not any(p.is_alive() for p in procs)
