"""Weights updated in place (/update_weights_from_disk, SGLang's shape): a checkpoint of the same
model served from the next request on, the prefix cache flushed, requests running meanwhile
finished on the old weights; a checkpoint that cannot replace the served one refused with a 400
naming why. HF on each checkpoint is the oracle."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from conftest import NEW_TOKENS, TINY_VOCAB, make_tiny_checkpoint
from helpers import assert_drained
from oracle import assert_matches, hf_greedy, random_prompts
from server.conftest import LiveServer, assert_kv_clean

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three tiny Llamas: `old`, `new` (the same shape, other weights) and `other` (another shape)."""
    import transformers

    root = tmp_path_factory.mktemp("update-weights")
    paths = {name: str(root / name) for name in ("old", "new", "other")}
    make_tiny_checkpoint("llama", paths["old"])
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["old"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    model.save_pretrained(paths["new"])
    make_tiny_checkpoint("llama", paths["other"], num_hidden_layers=3)
    hf = {name: transformers.AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32).eval()
          for name in ("old", "new")}
    prompts = random_prompts(TINY_VOCAB, 4, seed=5)
    refs = {name: hf_greedy(model, prompts, NEW_TOKENS) for name, model in hf.items()}
    assert [r.tokens for r in refs["old"]] != [r.tokens for r in refs["new"]], "the two checkpoints must differ"
    return paths, hf, prompts, refs


def test_the_engine_serves_the_new_weights_as_a_fresh_load_does(checkpoints):
    """On the native int8 kernels (codes laid out, the native decoder built over them): after the
    update, the same tokens as an engine started on the new checkpoint."""
    from radixlm.runtime.local_engine import LocalEngine

    paths, _, prompts, _ = checkpoints
    fresh = LocalEngine(paths["new"], skip_tokenizer_init=True, quantization="int8", max_total_tokens=4096)
    try:
        want = [r["output_ids"] for r in fresh.generate(input_ids=prompts, sampling_params=GREEDY)]
    finally:
        fresh.shutdown()
    engine = LocalEngine(paths["old"], skip_tokenizer_init=True, quantization="int8", max_total_tokens=4096)
    try:
        before = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert before != want
        assert engine.worker.native_decoder is not None
        ok, message = engine.update_weights_from_disk(paths["other"])
        assert not ok and "num_layers 3" in message, message
        ok, message = engine.update_weights_from_disk(paths["new"])
        assert ok, message
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == want
        # (the first two share nothing with the others: what they found cached came from the old weights)
        assert [r["meta_info"]["cached_tokens"] for r in results[:2]] == [0, 0], "the old weights' prefixes matched"
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_update_weights_from_disk_over_http(checkpoints):
    paths, _, prompts, refs = checkpoints
    srv = LiveServer("--model-path", paths["old"], "--skip-tokenizer-init")
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as client:
            def generate(ids, params=GREEDY):
                return client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()

            for i, prompt in enumerate(prompts):
                assert_matches(generate(prompt)["output_ids"], refs["old"][i], f"old weights, prompt {i}")

            # bad input: 400s naming what was wrong; the old weights serve on
            for body, named in (({}, "model_path"), ({"model_path": paths["old"] + "-missing"}, "does not exist"),
                                ({"model_path": paths["other"]}, "num_layers 3"),
                                ({"model_path": paths["new"], "load_format": "dummy"}, "load_format"),
                                ({"model_path": paths["new"], "abort_all_requests": "yes"}, "abort_all_requests")):
                r = client.post("/update_weights_from_disk", json=body)
                assert r.status_code == 400 and named in r.text, (body, r.status_code, r.text)
            assert_matches(generate(prompts[0])["output_ids"], refs["old"][0], "old weights after the refusals")

            # a request running when the update arrives finishes on the old weights
            long_params = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
            streamed: list[dict] = []
            started = threading.Event()

            def stream() -> None:
                with client.stream("POST", "/generate", json={"input_ids": prompts[1], "sampling_params": long_params,
                                                               "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            streamed.append(json.loads(line[6:]))
                            started.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert started.wait(120), "the stream never started"
            r = client.post("/update_weights_from_disk", json={"model_path": paths["new"]})
            reader.join(120)
            assert r.status_code == 200 and r.json()["success"], r.text
            assert streamed[-1]["meta_info"]["finish_reason"]["type"] == "length"
            want = hf_greedy(checkpoints[1]["old"], [prompts[1]], 120)[0]
            assert_matches(streamed[-1]["output_ids"], want, "the request running across the update")

            assert client.get("/get_model_info").json()["model_path"] == paths["new"]
            for i, prompt in enumerate(prompts):
                out = generate(prompt)
                assert_matches(out["output_ids"], refs["new"][i], f"new weights, prompt {i}")
                assert i > 1 or out["meta_info"]["cached_tokens"] == 0, "a prefix of the old weights was matched"
        assert_kv_clean(srv.url)
    finally:
        srv.stop()
