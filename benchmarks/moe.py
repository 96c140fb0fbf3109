"""A mixture of experts against a dense model of the same size: decode tokens/s, and the bytes of
weights each token reads (the experts read once per step, only those some row chose).

Two random Qwen3-style models made here with transformers' own classes (hidden 1024, 8 layers,
16 heads, 4 KV heads): a Qwen3-MoE with 16 experts of width 512, 2 a token, and a dense Qwen3 whose
MLP is 16 x 512 = 8192 wide (the same parameters), both served on the native kernels with
--quantization int4. Decode steps are timed on the scheduler at batch 1, 4 and 16 (the median of
many, 64-token prompts). The bytes a step reads are counted from its own routing: attention's and
the router's matrices, each expert some row of the step chose (`SparseMoE.forward` is wrapped to
count them), the LM head; per token, that over the batch.

    python benchmarks/moe.py            # about two minutes
    python benchmarks/moe.py --quick    # fewer steps, batch 1 and 4 (CI: the script works)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402
from radixlm.runtime.messages import TokenizedRequest  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime.worker.moe import SparseMoE  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 512


def make_models(root: str) -> dict[str, str]:
    import transformers

    torch.manual_seed(0)
    paths = {}
    for name, config in (
        ("MoE", transformers.Qwen3MoeConfig(**SHAPE, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                            moe_intermediate_size=EXPERT_WIDTH, intermediate_size=EXPERT_WIDTH,
                                            norm_topk_prob=True)),
        ("dense", transformers.Qwen3Config(**SHAPE, intermediate_size=EXPERTS * EXPERT_WIDTH)),
    ):
        path = os.path.join(root, name)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[name] = path
    return paths


class ExpertCount:
    """The experts each MoE layer's call ran (some row chose them), summed over calls."""

    def __init__(self) -> None:
        self.hit = 0
        original = SparseMoE.forward
        count = self

        def forward(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
            count.hit += int(torch.unique(block.route(x)[1]).numel())
            return original(block, x)

        SparseMoE.forward = forward  # type: ignore[method-assign]


def matrix_bytes(module: torch.nn.Module) -> int:
    """The bytes a decode step reads of a layer's matrix: its codes where quantized."""
    w = module.weight
    return int(w.nbytes)


def step_bytes(model: torch.nn.Module, experts_hit: float) -> float:
    """Weights a decode step reads: every layer's attention (and router), the MLP or the experts
    hit, the final norm's LM head."""
    total = matrix_bytes(model.lm_head)
    per_expert = 0
    for layer in model.layers:
        attn = layer.self_attn
        total += matrix_bytes(attn.qkv_proj) + matrix_bytes(attn.o_proj)
        if isinstance(layer.mlp, SparseMoE):
            total += layer.mlp.gate.weight.nbytes
            e = layer.mlp.experts[0]
            per_expert = matrix_bytes(e.gate_up_proj) + matrix_bytes(e.down_proj)
        else:
            total += matrix_bytes(layer.mlp.gate_up_proj) + matrix_bytes(layer.mlp.down_proj)
    return total + experts_hit * per_expert


def decode(path: str, batch: int, steps: int, count: ExpertCount) -> tuple[float, float]:
    """(median ms a decode step, bytes of weights a token read) at `batch` rows."""
    engine = LocalEngine(path, skip_tokenizer_init=True, max_total_tokens=8192, quantization="int4")
    s = engine.scheduler
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=steps + 16, temperature=0, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(10, SHAPE["vocab_size"], (64,), generator=gen).tolist()
        s.add_request(TokenizedRequest(uuid.uuid4().hex, prompt, params))
    for _ in range(8):  # the prefills, and a few decodes
        s.step()
    times, count.hit = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        s.step()
        times.append(time.perf_counter() - start)
    hit = count.hit / steps
    read = step_bytes(engine.worker.model, hit) / batch
    engine.shutdown()
    return statistics.median(times) * 1e3, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps, batches = (8, (1, 4)) if args.quick else (48, (1, 4, 16))
    print("\n".join(measure().lines()))
    count = ExpertCount()
    with tempfile.TemporaryDirectory() as root:
        paths = make_models(root)
        print(f"\nQwen3-style, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers; MoE: {EXPERTS} experts "
              f"of width {EXPERT_WIDTH}, {TOP_K} a token; dense: MLP width {EXPERTS * EXPERT_WIDTH}; --quantization int4\n")
        print("| model | batch | ms a step | tokens/s | MB of weights a token reads | experts run a MoE layer |")
        print("|---|---|---|---|---|---|")
        for batch in batches:
            for name, path in paths.items():
                ms, read = decode(path, batch, steps, count)
                layers = SHAPE["num_hidden_layers"]
                experts = f"{count.hit / steps / layers:.1f} of {EXPERTS}" if name == "MoE" else "-"
                print(f"| {name} | {batch} | {ms:.2f} | {batch * 1e3 / ms:.0f} | {read / 1e6:.1f} | {experts} |")


if __name__ == "__main__":
    main()
