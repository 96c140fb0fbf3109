"""Multi-LoRA: decode throughput of a batch whose rows use four adapters against one whose rows use
one adapter, and against the base model alone, on the embedded SmolLM2 (the defaults).

Four PEFT adapters made here with peft on SmolLM2's shapes (random weights; rank 16 on every
attention and MLP projection), served with `--lora-paths`. Each case: 16 requests of a 32-token
prompt, 64 tokens each (ignore_eos), all at once; output tokens per second over the whole batch,
the best of two runs.

    python benchmarks/lora.py
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402

ROWS, PROMPT, NEW, RANK = 16, 32, 64, 16
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, tie_word_embeddings=True)


def make_adapters(root: str, count: int) -> list[str]:
    import peft
    import transformers

    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2))
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=RANK, lora_alpha=2 * RANK, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        path = os.path.join(root, f"adapter{i}")
        model.save_pretrained(path)
        paths.append(path)
        base = model.unload()  # the base model without this adapter, for the next one
    return paths


def tokens_per_s(engine: LocalEngine, loras: list[str | None]) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(ROWS)]
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    best = 0.0
    for _ in range(2):
        engine.flush_cache()
        started = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
        best = max(best, ROWS * NEW / (time.perf_counter() - started))
    return best


def main() -> None:
    print("\n".join(measure().lines()))
    with tempfile.TemporaryDirectory() as root:
        paths = make_adapters(root, 4)
        engine = LocalEngine(lora_paths=[f"a{i}={p}" for i, p in enumerate(paths)])
        try:
            cases = {"base model": [None] * ROWS, "one adapter": ["a0"] * ROWS,
                     "four adapters, mixed": [f"a{i % 4}" for i in range(ROWS)]}
            rates = {name: tokens_per_s(engine, loras) for name, loras in cases.items()}
        finally:
            engine.shutdown()
    print(f"\nSmolLM2 (defaults), {ROWS} requests at once of {PROMPT} + {NEW} tokens; adapters of rank {RANK} on "
          "every projection\n")
    print("| rows on | output tok/s | against one adapter |\n|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / rates['one adapter']:.2f}x |")


if __name__ == "__main__":
    main()
