"""The SGLang-native HTTP API against a live server."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import orjson
import pytest

from oracle import LOGPROB_TOL, hf_logprobs
from server.conftest import assert_kv_clean

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def sse_events(server, body):
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def test_info_endpoints(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["context_length"] == 8192 and info["is_generation"]
    sinfo = httpx.get(server.url + "/get_server_info").json()
    assert sinfo["max_total_tokens"] == 30000 and sinfo["schedule_policy"] == "lpm"
    # the test server runs --quantization none (HF's weights); its fp32 weights and oneDNN's layout of each
    assert sinfo["quantization"] == "none" and sinfo["served_quantization"] == "none"
    assert sinfo["cpu_kernels_failure"] is None  # (a string where auto fell back to dense weights: the cause)
    assert sinfo["weight_formats"] == {"layers": "dense float32 (dequantized from Q4_1)",
                                       "embedding and LM head": "dense float32 (dequantized from Q8_0)"}
    assert 538e6 <= sinfo["weight_bytes"] <= 2 * 538.1e6
    # exact fp32 weights keep an fp32 KV (--kv-cache-dtype auto): 30 layers x K and V x 3 KV heads x 64 x 4 bytes
    assert sinfo["kv_cache_dtype"] == "fp32" and sinfo["kv_bytes_per_token"] == 46080


def test_generate_equals_in_process_engine(server, smol):
    prompts = [CHAT.format(q) for q in ("What is the capital of France?", "Name a primary colour.", "What is 2+2?")]
    params = {"max_new_tokens": 24, "temperature": 0}
    served = post(server, "/generate", {"text": prompts, "sampling_params": params}).json()
    local = smol.engine.generate(prompts, params)
    assert [s["output_ids"] for s in served] == [r["output_ids"] for r in local]
    assert [s["text"] for s in served] == [r["text"] for r in local]
    assert "Paris" in served[0]["text"]
    meta = served[0]["meta_info"]
    assert meta["prompt_tokens"] == len(smol.engine.tokenizer.encode(prompts[0], add_special_tokens=False))
    assert [s["meta_info"]["finish_reason"] for s in served] == [r["meta_info"]["finish_reason"] for r in local]
    assert_kv_clean(server.url)


def _assert_logprobs_match_hf(smol, prompt: list[int], result: dict, start: int, top: int,
                              with_text: bool = False) -> None:
    """The prompt's logprobs from `start` and the output's, each with its `top` alternatives, are the
    HF reference's (fp32, teacher-forced on the prompt and the output); greedy picked the best."""
    meta, output = result["meta_info"], result["output_ids"]
    ref = hf_logprobs(smol.hf, prompt + output)  # row p scores token p + 1
    decode = smol.engine.tokenizer.decode
    scored = [(p, t, lp, alts) for p, (t, lp, alts) in enumerate(zip(
        prompt[start:], meta["input_token_logprobs"], meta["input_top_logprobs"]), start)]
    scored += [(len(prompt) + i, t, lp, alts) for i, (t, lp, alts) in enumerate(zip(
        output, meta["output_token_logprobs"], meta["output_top_logprobs"]))]
    assert len(scored) == len(prompt) - start + len(output), meta
    for pos, token, (lp, lp_token, *text), alts in scored:
        # SGLang's entries: [logprob, id, text], the text null unless asked for
        assert lp_token == token and text == [decode([token]) if with_text else None], (pos, lp_token, text)
        if pos == 0:  # nothing scores the first token
            assert lp is None and alts is None, (lp, alts)
            continue
        assert lp == pytest.approx(ref[pos - 1, token].item(), abs=LOGPROB_TOL), pos
        # the alternatives are the reference's best `top`, in its order up to near-ties: each scores what the
        # reference gives it, and their scores are the reference's best scores
        best = ref[pos - 1].topk(top)
        assert [v for v, *_ in alts] == pytest.approx(best.values.tolist(), abs=LOGPROB_TOL), pos
        assert [v for v, *_ in alts] == pytest.approx([ref[pos - 1, t].item() for _, t, *_ in alts],
                                                      abs=LOGPROB_TOL), (pos, alts, best)
    for pos, token, _, alts in scored[len(prompt) - start:]:
        assert token == alts[0][1], f"output token at {pos} is not the greedy choice: {alts}"


def test_input_ids_n_and_logprobs(server, smol):
    prompts = [[504, 3575, 282, 4649, 314], [33, 28, 216, 34]]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    res = post(server, "/generate", body).json()
    assert len(res) == 4 and res[0]["output_ids"] == res[1]["output_ids"]
    for i, r in enumerate(res):
        assert len(r["output_ids"]) == 4
        _assert_logprobs_match_hf(smol, prompts[i // 2], r, start=0, top=2, with_text=True)
    later = post(server, "/generate", {**body, "input_ids": prompts[0], "logprob_start_len": 3,
                                       "return_text_in_logprobs": False}).json()
    assert len(later) == 2 and len(later[0]["meta_info"]["input_token_logprobs"]) == len(prompts[0]) - 3
    _assert_logprobs_match_hf(smol, prompts[0], later[0], start=3, top=2)


def test_max_new_tokens_zero_prefills_and_caches(server, smol):
    prompt = CHAT.format("[max_new_tokens 0] " + "Tell me about the moon, " * 12)  # new to the cache
    res = post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}).json()
    ids = smol.engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert res["output_ids"] == [] and res["meta_info"]["prompt_tokens"] == len(ids)
    _assert_logprobs_match_hf(smol, ids, res, start=0, top=1)
    again = post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    page = httpx.get(server.url + "/get_server_info", timeout=30).json()["page_size"]
    # all of it cached but the last token, which is computed for the next token's logits
    assert again["meta_info"]["cached_tokens"] == (len(ids) - 1) // page * page


def test_streaming_text_equals_non_streaming(server):
    body = {"text": CHAT.format("Write one sentence about cats."), "sampling_params": {"max_new_tokens": 30, "temperature": 0}}
    whole = post(server, "/generate", body).json()
    chunks = sse_events(server, {**body, "stream": True})
    # SGLang's shape: each chunk holds everything so far, and it only grows
    assert len(chunks) > 1 and chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"]) and len(after["output_ids"]) > len(before["output_ids"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_stream_interval_sends_a_chunk_every_n_tokens(server):
    body = {"text": CHAT.format("Write two sentences about dogs."), "stream": True,
            "sampling_params": {"max_new_tokens": 21, "temperature": 0, "ignore_eos": True, "stream_interval": 5}}
    counts = [len(c["output_ids"]) for c in sse_events(server, body)]
    assert counts == [5, 10, 15, 20, 21]


def test_streamed_logprobs_accumulate(server):
    body = {"text": CHAT.format("Name three fruits."), "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    whole = post(server, "/generate", body).json()["meta_info"]
    last = sse_events(server, {**body, "stream": True})[-1]["meta_info"]
    streamed, once = last["output_token_logprobs"], whole["output_token_logprobs"]
    assert len(streamed) == 8 and [e[1] for e in streamed] == [e[1] for e in once]
    # the second run's prompt comes from the cache: its last token computed alone, in another GEMM
    # shape, so the logprobs agree to the oracle's stated tolerance, not to the bit
    assert [e[0] for e in streamed] == pytest.approx([e[0] for e in once], abs=LOGPROB_TOL)
    assert [[t[1] for t in top] for top in last["output_top_logprobs"]] == [
        [t[1] for t in top] for top in whole["output_top_logprobs"]]


def test_stop_string_never_leaks_into_the_stream(server):
    body = {"text": CHAT.format("What is the capital of France?"),
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "stop": ["Paris"]}}
    chunks = sse_events(server, {**body, "stream": True})
    text = chunks[-1]["text"]
    assert not any("Par" in c["text"] for c in chunks) and chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    assert post(server, "/generate", body).json()["text"] == text


def test_64_concurrent_streams(server):
    prompts = [CHAT.format(f"Say the number {i} in words.") for i in range(64)]
    params = {"max_new_tokens": 12, "temperature": 0}
    expected = [r["text"] for r in post(server, "/generate", {"text": prompts, "sampling_params": params}).json()]
    with cf.ThreadPoolExecutor(64) as pool:
        streamed = list(pool.map(lambda p: sse_events(
            server, {"text": p, "sampling_params": params, "stream": True})[-1]["text"], prompts))
    assert streamed == expected
    assert_kv_clean(server.url)


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    body = {"text": CHAT.format("Write a very long story about a dragon."), "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream: the connection closes
    assert_kv_clean(server.url)
    assert post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_flush_cache_and_abort_request(server):
    post(server, "/generate", {"text": "warm the cache " * 10, "sampling_params": {"max_new_tokens": 1}})
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    acct = httpx.get(server.url + "/debug/kv_accounting", timeout=30).json()
    assert acct["evictable_pages"] == 0 and acct["free_pages"] == acct["pool_pages"]
    assert httpx.post(server.url + "/abort_request", json={"rid": "nobody"}, timeout=30).status_code == 200
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, server, "/generate", {"text": "a long one", "rid": "to-abort",
                                                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
        import time

        time.sleep(1.5)
        httpx.post(server.url + "/abort_request", json={"rid": "to-abort"}, timeout=30)
        res = fut.result(timeout=60)
    assert res.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_kv_clean(server.url)


def _metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_metrics_count_what_was_served(server):
    before = httpx.get(server.url + "/metrics").text
    prompt = CHAT.format("Describe the sea in a few words. " * 5)
    for _ in range(2):  # the second one hits the prefix cache
        res = post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                             "ignore_eos": True}}).json()
    after = httpx.get(server.url + "/metrics").text
    delta = lambda name: _metric(after, name) - _metric(before, name)  # noqa: E731
    assert delta("radixlm_generation_tokens_total") == 10
    assert delta("radixlm_prompt_tokens_total") == 2 * res["meta_info"]["prompt_tokens"]
    assert delta("radixlm_cached_tokens_total") >= res["meta_info"]["prompt_tokens"] - 1
    assert delta("radixlm_time_to_first_token_seconds_count") == 2
    assert delta("radixlm_inter_token_latency_seconds_count") == 2
    assert delta("radixlm_e2e_request_latency_seconds_count") == 2
    assert 0 < _metric(after, "radixlm_cache_hit_rate") <= 1
    assert _metric(after, "radixlm_num_running_requests") == 0
    assert res["meta_info"]["e2e_latency"] >= res["meta_info"]["time_to_first_token"] > 0


def test_disconnect_while_waiting_for_a_whole_result_aborts(server):
    body = {"text": ["Write a long poem. " * 3, "Another long one. " * 3],
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, timeout=2.0)  # gives up: the connection closes
    assert_kv_clean(server.url)


@pytest.mark.parametrize("constraint", [
    {"regex": "(abcdefgh|abcdefgi)xyz"},  # the sampled start of the word is re-encoded with its forced end
    {"json_schema": '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, '
                    '"age": {"type": "integer"}}, "required": ["name", "age"]}'},
])
def test_jump_forward_stream_equals_whole_result(server, constraint):
    """Jump-forward may re-encode tokens already streamed: the text never changes, and each
    chunk's ids are the output's ids so far (so they can change, not only grow)."""
    body = {"text": CHAT.format("Where are you going? Describe yourself."),
            "sampling_params": {"max_new_tokens": 60, "temperature": 0, **constraint}}
    whole = post(server, "/generate", body).json()
    chunks = sse_events(server, {**body, "stream": True})
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert not any("replaced_tokens" in c["meta_info"] for c in chunks)
    if "regex" in constraint:  # some chunk re-encoded ids an earlier one sent
        assert any(b["output_ids"][:len(a["output_ids"])] != a["output_ids"] for a, b in zip(chunks, chunks[1:]))
    assert_kv_clean(server.url)
