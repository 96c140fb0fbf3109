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
    finally:
        engine.shutdown()
