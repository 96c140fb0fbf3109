"""Multi-LoRA against HF + peft: adapters made by peft with random weights on the tiny Llama,
rows of three adapters and of the base model in one step, each equal to peft's greedy decoding of
its own adapter; a prefix is never shared across adapters."""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS
from helpers import assert_drained
from oracle import assert_matches, hf_greedy

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
SPECS = {  # attention alone; the MLP alone, rsLoRA; some of each, rank 2
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "mixed": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> (path, the peft model on the tiny Llama)."""
    import peft
    import transformers

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        torch.manual_seed(100 + i)
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama.path, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():  # B about as large as A: each adapter moves the greedy tokens
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0.0, 0.3)
        model.save_pretrained(str(root / name))
        out[name] = (str(root / name), model.eval())
    return out


def test_a_step_of_three_adapters_and_the_base_model_matches_peft(tiny_llama, adapters):
    names = [None, "attn", "mlp", "mixed"]
    prompts = tiny_llama.prompts[:8]
    # every prompt under two adapters (or one and the base): the same prompt twice in one batch,
    # which a prefix shared across adapters would give the same KV
    pairs = [(p, names[i % 4]) for i, p in enumerate(prompts)] + [(p, names[(i + 1) % 4]) for i, p in enumerate(prompts)]
    engine = tiny_llama.engine(lora_paths=[f"{n}={adapters[n][0]}" for n in SPECS], overlap_schedule="off")
    try:
        assert sorted(engine.worker.loras) == sorted(SPECS)
        results = engine.generate(input_ids=[p for p, _ in pairs], sampling_params=GREEDY,
                                  lora_path=[n for _, n in pairs])
        moved = 0
        for i, ((prompt, name), res) in enumerate(zip(pairs, results)):
            if name is None:
                ref = tiny_llama.refs[tiny_llama.prompts.index(prompt)]
            else:
                ref = hf_greedy(adapters[name][1], [prompt], NEW_TOKENS)[0]
                moved += ref.tokens != tiny_llama.refs[tiny_llama.prompts.index(prompt)].tokens
            assert_matches(res["output_ids"], ref, f"prompt {i} on {name or 'the base model'}")
        assert moved >= 10, "the adapters barely change the outputs: the test would not see one dropped"
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_bad_adapters_and_unknown_names_are_refused(tiny_llama, adapters, tmp_path):
    import json

    from radixlm.runtime.worker.lora import LoraError

    bad = tmp_path / "dora"
    bad.mkdir()
    path = adapters["attn"][0]
    config = json.load(open(f"{path}/adapter_config.json"))
    json.dump({**config, "use_dora": True}, open(bad / "adapter_config.json", "w"))
    (bad / "adapter_model.safetensors").write_bytes(open(f"{path}/adapter_model.safetensors", "rb").read())
    with pytest.raises(LoraError, match="use_dora"):
        tiny_llama.engine(lora_paths=[f"dora={bad}"])
    with pytest.raises(LoraError, match="rank 8, above --max-lora-rank 4"):
        tiny_llama.engine(lora_paths=[f"mlp={adapters['mlp'][0]}"], max_lora_rank=4)
    engine = tiny_llama.engine(lora_paths=[f"attn={path}"])
    try:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            engine.generate(input_ids=tiny_llama.prompts[0], sampling_params=GREEDY, lora_path="nope")
        # the adapters served still apply once the base weights are updated in place
        assert engine.update_weights_from_disk(tiny_llama.path)[0]
        prompt = tiny_llama.prompts[1]
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="attn")
        assert_matches(out["output_ids"], hf_greedy(adapters["attn"][1], [prompt], NEW_TOKENS)[0], "after an update")
    finally:
        engine.shutdown()


def test_deterministic_lora_rows_are_bitwise_the_same_alone_and_mixed(tiny_llama, adapters):
    """--deterministic: a row's tokens and logprobs do not depend on the adapters beside it."""
    names = ["attn", "mlp", None, "mixed"]
    prompts = tiny_llama.prompts[:4]
    engine = tiny_llama.engine(lora_paths=[f"{n}={adapters[n][0]}" for n in SPECS], deterministic=True,
                               overlap_schedule="off")
    try:
        params = {**GREEDY, "max_new_tokens": 8}
        alone = [engine.generate(input_ids=p, sampling_params=params, lora_path=n, return_logprob=True)
                 for p, n in zip(prompts, names)]
        engine.flush_cache()
        mixed = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names, return_logprob=True)
        for a, m in zip(alone, mixed):
            assert a["output_ids"] == m["output_ids"]
            assert a["meta_info"]["output_token_logprobs"] == m["meta_info"]["output_token_logprobs"]
        assert_drained(engine)
    finally:
        engine.shutdown()


def _peft_adapter(base_path: str, out: str, seed: int, **spec) -> str:
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **spec))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


def test_adapters_over_http_by_name_and_loaded_at_run_time(tiny_qwen3, tmp_path):
    """The OpenAI API's `model` names an adapter as the native `lora_path` does; /v1/models lists
    the adapters; /load_lora_adapter and /unload_lora_adapter change what is served."""
    import httpx
    import openai

    from server.conftest import LiveServer, assert_kv_clean

    first = _peft_adapter(tiny_qwen3, str(tmp_path / "first"), 1, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    second = _peft_adapter(tiny_qwen3, str(tmp_path / "second"), 2, r=2, lora_alpha=2, target_modules=["o_proj"])
    srv = LiveServer("--model-path", tiny_qwen3, "--lora-paths", f"first={first}")
    try:
        http = httpx.Client(base_url=srv.url, timeout=120)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")

        def native(lora, status=200):
            r = http.post("/generate", json={"text": "Once upon a time", "lora_path": lora,
                                             "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
            assert r.status_code == status, r.text
            return r.json()["text"] if status == 200 else r.json()["error"]["message"]

        base_name = client.models.list().data[0].id
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {base_name, "first"} and cards["first"].model_extra["parent"] == base_name
        via_openai = client.completions.create(model="first", prompt="Once upon a time", max_tokens=12,
                                               temperature=0).choices[0].text
        assert via_openai == native("first") != native(None)

        r = http.post("/load_lora_adapter", json={"lora_name": "second", "lora_path": second})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert {m.id for m in client.models.list().data} == {base_name, "first", "second"}
        assert native("second") not in (native("first"), native(None))
        for body, status, named in (({"lora_name": "second", "lora_path": second}, 400, "already loaded"),
                                    ({"lora_name": "third", "lora_path": str(tmp_path / "none")}, 400, "not a folder"),
                                    ({"lora_name": "third"}, 400, "lora_path")):
            r = http.post("/load_lora_adapter", json=body)
            assert r.status_code == status and named in r.text, (body, r.text)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert r.status_code == 200, r.text
        assert "unknown LoRA adapter 'second'" in native("second", status=400)
        assert {m.id for m in client.models.list().data} == {base_name, "first"}
        assert http.post("/unload_lora_adapter", json={"lora_name": "second"}).status_code == 400
        assert_kv_clean(srv.url)
    finally:
        srv.stop()


def test_adapters_beyond_max_loaded_loras_are_read_again_when_named(tiny_llama, adapters):
    """--max-loaded-loras 1: each step's adapters are in memory (the others dropped, least recently
    used first), and one dropped is read again when a request names it: the same tokens as peft."""
    engine = tiny_llama.engine(lora_paths=[f"{n}={adapters[n][0]}" for n in SPECS], max_loaded_loras=1)
    try:
        prompt = tiny_llama.prompts[0]
        for name in ("attn", "mlp", "attn", "mixed"):
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
            assert_matches(out["output_ids"], hf_greedy(adapters[name][1], [prompt], NEW_TOKENS)[0], name)
            assert [n for n, a in engine.worker.loras.items() if a.pairs] == [name]
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_an_adapter_on_smollm2_matches_peft(smol, tmp_path):
    """The embedded SmolLM2 (fp32, the weights HF runs) with a peft adapter on every projection,
    beside base-model rows in the same step: peft's greedy tokens for the adapter's rows, HF's for
    the others."""
    import copy

    import peft

    torch.manual_seed(7)
    model = peft.get_peft_model(copy.deepcopy(smol.hf), peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.save_pretrained(str(tmp_path / "smol-adapter"))
    prompts = smol.prompts[:2]
    engine = smol.engine_with(lora_paths=[f"smol-adapter={tmp_path / 'smol-adapter'}"])
    try:
        results = engine.generate(input_ids=prompts * 2, sampling_params=GREEDY,
                                  lora_path=["smol-adapter", "smol-adapter", None, None])
        refs = hf_greedy(model.eval(), prompts, NEW_TOKENS)
        for i, (res, ref) in enumerate(zip(results, refs + smol.refs[:2])):
            assert_matches(res["output_ids"], ref, f"SmolLM2 prompt {i % 2} {'on the adapter' if i < 2 else 'alone'}")
        assert [r.tokens for r in refs] != [r.tokens for r in smol.refs[:2]], "the adapter must move the tokens"
        assert_drained(engine)
    finally:
        engine.shutdown()
