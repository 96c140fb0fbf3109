"""Multi-LoRA against HF + peft: adapters made by peft with random weights on the tiny Llama,
rows of three adapters and of the base model in one step, each equal to peft's greedy decoding of
its own adapter; a prefix is never shared across adapters."""

from __future__ import annotations

import re

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
    broken = _broken_adapters(first, tmp_path)
    srv = LiveServer("--model-path", tiny_qwen3, "--lora-paths", f"first={first}", "--enable-runtime-lora-updates")
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
        assert native("second") not in (native("first"), native(None))
        refused = [({"lora_name": "second", "lora_path": second}, "already loaded"),
                   ({"lora_name": base_name, "lora_path": second}, "taken by the served model"),
                   ({"lora_name": "third", "lora_path": str(tmp_path / "none")}, "not a folder"),
                   ({"lora_name": "third"}, "lora_path")]
        refused += [({"lora_name": "third", "lora_path": path}, named) for path, named in broken]
        for body, named in refused:  # each a 400 naming the fault; the scheduler serves on, unchanged
            r = http.post("/load_lora_adapter", json=body)
            assert r.status_code == 400 and named in r.text, (body, r.text)
        assert [m.id for m in client.models.list().data] == [base_name, "first", "second"]
        assert native("first") == via_openai
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert r.status_code == 200, r.text
        assert "unknown LoRA adapter 'second'" in native("second", status=400)
        assert {m.id for m in client.models.list().data} == {base_name, "first"}
        assert http.post("/unload_lora_adapter", json={"lora_name": "second"}).status_code == 400
        assert_kv_clean(srv.url)
    finally:
        srv.stop()


def test_adapter_changes_are_refused_without_the_flag(server, tmp_path):
    """A load reads the folder the request names on the server's machine: without
    --enable-runtime-lora-updates (the shared server has none) both changes are refused, naming
    the flag, before anything is read (vLLM asks for VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    import httpx

    before = httpx.get(server.url + "/v1/models", timeout=30).json()
    for path, body in (("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 403 and "--enable-runtime-lora-updates" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/v1/models", timeout=30).json()["data"] == before["data"]


def _broken_adapters(good: str, root) -> list[tuple[str, str]]:
    """Folders that look like adapters and are not, each beside the phrase its refusal names:
    made from the adapter at `good`."""
    import json
    import shutil

    config = json.load(open(f"{good}/adapter_config.json"))
    cases = {
        "bad-json": ('{"r": 4, ', None, "is not readable JSON"),
        "list-config": (json.dumps([config]), None, "holds a list, not an object"),
        "bad-alpha-pattern": (json.dumps({**config, "alpha_pattern": {"q_proj(": 4}}), None,
                              "alpha_pattern key 'q_proj(' is not a regular expression"),
        "lfs-pointer": (None, b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 9\n", "git-LFS pointer"),
        "truncated": (None, open(f"{good}/adapter_model.safetensors", "rb").read()[:100], "cannot be read"),
    }
    out = []
    for name, (config_text, weights, named) in cases.items():
        folder = root / name
        shutil.copytree(good, folder)
        if config_text is not None:
            (folder / "adapter_config.json").write_text(config_text)
        if weights is not None:
            (folder / "adapter_model.safetensors").write_bytes(weights)
        out.append((str(folder), named))
    return out


def test_broken_adapters_are_refused_by_name_and_change_nothing(tiny_llama, adapters, tmp_path, monkeypatch):
    """Whatever is wrong with an adapter's files is a LoraError naming it (the served runtime's
    400), also a failure no check foresaw; the adapters served and their outputs stay as they were."""
    from radixlm.runtime.worker import lora
    from radixlm.runtime.worker.lora import LoraError

    path = adapters["attn"][0]
    engine = tiny_llama.engine(lora_paths=[f"attn={path}"])
    try:
        for folder, named in _broken_adapters(path, tmp_path):
            with pytest.raises(LoraError, match=re.escape(named)):
                engine.load_lora_adapter("broken", folder)

        def unforeseen(*args, **kwargs):
            raise RuntimeError("a disk that went away")

        with monkeypatch.context() as m:
            m.setattr(lora, "load_adapter", unforeseen)
            with pytest.raises(LoraError, match="could not be read .*RuntimeError: a disk that went away"):
                engine.load_lora_adapter("broken", path)
        assert engine.control.adapters() == {"attn": path}
        prompt = tiny_llama.prompts[2]
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="attn")
        assert_matches(out["output_ids"], hf_greedy(adapters["attn"][1], [prompt], NEW_TOKENS)[0], "after the refusals")
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_an_adapter_may_not_take_a_name_already_served(tiny_llama, adapters):
    """Not the served model's name (--served-model-name, or by default its folder's), at start or at
    run time, nor an adapter's: every request for the base model would run the adapter."""
    import os

    from radixlm.runtime.worker.lora import LoraError

    path = adapters["attn"][0]
    folder_name = os.path.basename(tiny_llama.path)
    with pytest.raises(LoraError, match=f"the name '{folder_name}' is taken by the served model"):
        tiny_llama.engine(lora_paths=[f"{folder_name}={path}"])
    engine = tiny_llama.engine(lora_paths=[f"attn={path}"], served_model_name="tiny")
    try:
        for name, named in (("tiny", "taken by the served model"), ("attn", "taken by an adapter already loaded")):
            with pytest.raises(LoraError, match=named):
                engine.load_lora_adapter(name, adapters["mlp"][0])
        assert engine.control.adapters() == {"attn": path}
    finally:
        engine.shutdown()


def test_a_request_for_an_adapter_unloaded_meanwhile_is_refused_alone(tiny_llama, adapters):
    """A request prepared while its adapter was served that reaches the scheduler after the unload
    (the tokenizer process checks nothing of adapters: the scheduler owns them) is a 400 naming the
    adapter; the requests beside it run as if it had never come."""
    from radixlm.runtime.messages import GenerateRequest
    from radixlm.runtime.native import BadRequest

    engine = tiny_llama.engine(lora_paths=[f"attn={adapters['attn'][0]}"])
    try:
        prompt = tiny_llama.prompts[3]
        base = engine.prep.prepare(GenerateRequest("base", input_ids=prompt, sampling_params=GREEDY))
        late = engine.prep.prepare(GenerateRequest("late", input_ids=prompt, sampling_params=GREEDY, lora_path="attn"))
        engine.scheduler.add_request(base)
        engine.unload_lora_adapter("attn")
        with pytest.raises(BadRequest, match="unknown LoRA adapter 'attn' \\(served: none\\)"):
            engine.scheduler.add_request(late)
        tokens = []
        while engine.scheduler.has_work:
            tokens += [t for out in engine.scheduler.step() for t in out.new_token_ids]
        assert_matches(tokens, tiny_llama.refs[3], "the request beside it")
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_adapters_change_only_between_steps_under_overlap(tiny_llama, adapters):
    """With overlap scheduling a step runs on its own thread while the scheduler goes on: an adapter
    loaded (or unloaded) meanwhile would evict the adapters and stacked pairs the running step
    reads. The control path takes the step back first. Here the step is held until someone waits
    for it, so without that the load would run inside it."""
    import threading

    from radixlm.runtime.messages import GenerateRequest

    engine = tiny_llama.engine(lora_paths=[f"attn={adapters['attn'][0]}"], overlap_schedule="on", max_loaded_loras=1)
    worker, s = engine.worker, engine.scheduler
    release, inside = threading.Event(), []
    real_forward, real_load = worker.forward, worker.load_lora

    def held_forward(batch):
        inside.append(True)
        release.wait()
        try:
            return real_forward(batch)
        finally:
            inside.pop()

    def watched_load(name, path):
        loads_inside.append(bool(inside))
        release.set()  # (without the fix, the held step may go on now)
        real_load(name, path)

    class Waited:  # the launched step's result: it runs on once someone waits for it
        def __init__(self, future):
            self.future = future

        def result(self):
            release.set()
            return self.future.result()

    loads_inside: list[bool] = []
    worker.forward, worker.load_lora = held_forward, watched_load
    try:
        prompt = tiny_llama.prompts[4]
        s.add_request(engine.prep.prepare(GenerateRequest("on-attn", input_ids=prompt, sampling_params=GREEDY,
                                                          lora_path="attn")))
        s.step()  # launches the prefill (held)
        s._in_flight = s._in_flight._replace(result=Waited(s._in_flight.result))
        engine.load_lora_adapter("mlp", adapters["mlp"][0])  # --max-loaded-loras 1: evicts attn's pairs
        assert loads_inside == [False], "the adapter was loaded while a step ran"
        tokens = []
        while s.has_work:
            tokens += [t for out in s.step() for t in out.new_token_ids]
        assert_matches(tokens, hf_greedy(adapters["attn"][1], [prompt], NEW_TOKENS)[0], "the request on attn")
        assert_drained(engine)
    finally:
        worker.forward, worker.load_lora = real_forward, real_load
        release.set()
        engine.shutdown()


def test_alpha_pattern_is_matched_as_peft_matches_it(tiny_llama, tmp_path):
    """alpha_pattern keys match a module's whole name or its dotted tail (peft's get_pattern_key):
    "q_proj" scales q_proj alone (not qkv_proj's other blocks: v_proj is a substring of our fused
    name), "layers.1.mlp.down_proj" one layer's. peft's greedy tokens are the oracle."""
    import peft

    path = _peft_adapter(tiny_llama.path, str(tmp_path / "patterned"), 5, r=4, lora_alpha=4,
                         target_modules=["q_proj", "v_proj", "down_proj"],
                         alpha_pattern={"q_proj": 32, "layers.1.mlp.down_proj": 16})
    model = peft.PeftModel.from_pretrained(tiny_llama.hf, path).eval()
    engine = tiny_llama.engine(lora_paths=[f"patterned={path}"])
    try:
        prompts = tiny_llama.prompts[5:7]
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="patterned")
        refs = hf_greedy(model, prompts, NEW_TOKENS)
        for i, (res, ref) in enumerate(zip(results, refs)):
            assert_matches(res["output_ids"], ref, f"prompt {i}")
        assert_drained(engine)
    finally:
        model.unload()  # (tiny_llama.hf is shared: peft's layers taken out again)
        engine.shutdown()


def test_an_adapters_kv_never_comes_back_from_the_kv_tier(tiny_llama, adapters, tmp_path):
    """A KV tier keeps what was evicted, also across restarts; an adapter's prefixes are keyed in a
    namespace numbered by this process (the first adapter loaded gets the first), so after a
    restart the same keys name another adapter. Adapters' KV stays out of the tier: a second
    engine serving another adapter first gets that adapter's tokens, not the first one's KV."""
    tier = str(tmp_path / "tier")
    prompt = tiny_llama.prompts[8]
    for name in ("attn", "mlp"):
        engine = tiny_llama.engine(lora_paths=[f"{name}={adapters[name][0]}"], kv_tier_path=tier)
        try:
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
            assert_matches(out["output_ids"], hf_greedy(adapters[name][1], [prompt], NEW_TOKENS)[0], name)
            base = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            assert_matches(base["output_ids"], tiny_llama.refs[8], f"the base model beside {name}")
            assert_drained(engine)
        finally:
            engine.shutdown()  # (saves the tree to the tier)


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
