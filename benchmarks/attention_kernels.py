"""The native attention kernels on this CPU, each ISA path it runs, at SmolLM2-135M's heads (9
query heads over 3 KV heads, 64 dimensions), one layer, best of 5, on pools of each KV type
(--kv-cache-dtype: fp32, fp16, bf16, int8): ms per call and GFLOP/s (4 d FLOPs a visible (query
head, key) pair: its score and its weighted value).

1. Extend attention (`radixlm.kernels.cpu.extend_attention`: prefill chunks over a cached
   prefix) against what the torch backend does (keys and values gathered through the token
   table and converted to fp32, torch's fused SDPA with a causal mask), at the shapes a step
   meets: a 256-token chunk of a long prompt, a prompt's first chunk, several short prompts on
   one cached system prompt.
2. Decode rows on one cached system prompt (`decode_attention`): the exact kernel
   (--deterministic: each row bitwise itself alone) against the blocked one the default takes
   (`exact=False`: the rows of a set share the prompt's key blocks).

3. Decode at other families' heads, fp16 pool: Gemma 2's (8 over 4 x 256, scores soft-capped at
   50), gpt-oss's (64 over 8 x 64, a sink logit per head) and SmolLM2's plain ones, one row over
   2,000 keys and 16 rows over 1,000 each (the exact kernel): the capped and sink layers must stay
   on the vector paths, and the plain kernel must not pay for them.

    python benchmarks/attention_kernels.py            # about a minute
    python benchmarks/attention_kernels.py --quick    # three shapes, fp32 and fp16 (CI)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import best_of, kernel_bench_args  # noqa: E402
from radixlm.kernels import cpu  # noqa: E402
from radixlm.runtime.cache.kv_pool import KV_DTYPES, KVDtype  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = DIM ** -0.5
# (rows, new tokens each, cached prefix): what a prefill step of the online workloads holds
SHAPES = [(1, 256, 0), (1, 256, 768), (4, 64, 1000), (1, 64, 1000), (8, 32, 500)]
# (decode rows, the prompt they share, each row's own keys after it)
DECODE_SHAPES = [(16, 1000, 20), (8, 1000, 20), (16, 4000, 20)]
KV_TYPES = ["fp32", "fp16", "bf16", "int8"]  # what the native kernels read


def flops(rows: int, new: int, prefix: int) -> float:
    keys_seen = sum(prefix + j + 1 for j in range(new))
    return 4.0 * DIM * HEADS * keys_seen * rows


def pools(kv: KVDtype, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv.encode(torch.randn(KV_HEADS, slots, DIM)), kv.encode(torch.randn(KV_HEADS, slots, DIM))


def cell(seconds: float, work: float) -> str:
    return f"{seconds * 1e3:.2f} ms, {work / seconds / 1e9:.0f} GFLOP/s"


def extend_table(paths: list[int], shapes: list[tuple[int, int, int]], kv_types: list[str]) -> None:
    print("| rows x new tokens, cached prefix | KV | " + " | ".join(f"native {cpu.ISA_NAMES[i]}" for i in paths)
          + " | torch gather + SDPA |")
    print("|---|---|" + "---|" * (len(paths) + 1))
    slots = 12000
    for rows, new, prefix in shapes:
        width = prefix + new
        table = torch.randperm(slots)[: rows * width].view(rows, width)  # scattered slots, as pages are
        req_rows = torch.arange(rows)
        prefix_lens, extend_lens = torch.full((rows,), prefix), torch.full((rows,), new)
        q = torch.randn(rows * new, HEADS * DIM)
        out = torch.empty_like(q)
        mask = torch.arange(width)[None, :] <= (prefix + torch.arange(new))[:, None]
        for name in kv_types:
            kv = KV_DTYPES[name]
            k_pool, v_pool = pools(kv, slots)

            def torch_path() -> torch.Tensor:
                keys = kv.decode(k_pool[:, table], torch.float32).transpose(0, 1)  # [rows, kv_heads, width, d]
                values = kv.decode(v_pool[:, table], torch.float32).transpose(0, 1)
                queries = q.view(rows, new, HEADS, DIM).transpose(1, 2)
                return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=SCALE, enable_gqa=True)

            want = torch_path().transpose(1, 2).reshape(rows * new, HEADS * DIM)
            times = []
            for isa in paths:
                got = cpu.extend_attention(q, k_pool, v_pool, table, req_rows, prefix_lens, extend_lens, SCALE, out=out,
                                           isa=isa)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (name, cpu.ISA_NAMES[isa], (got - want).abs().max())
                times.append(best_of(5, cpu.extend_attention, q, k_pool, v_pool, table, req_rows, prefix_lens,
                                     extend_lens, SCALE, out, isa))
            times.append(best_of(5, torch_path))
            work = flops(rows, new, prefix)
            print(f"| {rows} x {new}, {prefix} | {name} | " + " | ".join(cell(t, work) for t in times) + " |")


def decode_table(paths: list[int], shapes: list[tuple[int, int, int]], kv_types: list[str]) -> None:
    print("\n| decode rows, shared prompt + own keys | KV | " + " | ".join(
        f"{cpu.ISA_NAMES[i]} exact | {cpu.ISA_NAMES[i]} blocked" for i in paths) + " |")
    print("|---|---|" + "---|" * (2 * len(paths)))
    slots = max(n * (shared + own) for n, shared, own in shapes)
    for n, shared, own in shapes:
        table = torch.randperm(slots)[: n * (shared + own)].view(n, shared + own)
        table[:, :shared] = table[0, :shared].clone()  # one cached prompt's slots in every row
        rows, lens = torch.arange(n), torch.full((n,), shared + own)
        q = torch.randn(n, HEADS * DIM)
        work = 4.0 * DIM * HEADS * (shared + own) * n
        for name in kv_types:
            k_pool, v_pool = pools(KV_DTYPES[name], slots)
            times = [best_of(5, cpu.decode_attention, q, k_pool, v_pool, table, rows, lens, SCALE, isa, 0, 0.0, None,
                             exact) for isa in paths for exact in (True, False)]
            print(f"| {n}, {shared} + {own} | {name} | " + " | ".join(
                f"{t * 1e6:.0f} us, {work / t / 1e9:.0f} GFLOP/s" for t in times) + " |")


# (family, query heads, KV heads, head_dim, soft cap, sinks)
FAMILY_HEADS = [("Gemma 2 2B", 8, 4, 256, 50.0, False), ("gpt-oss 20B", 64, 8, 64, 0.0, True),
                ("SmolLM2 (plain)", HEADS, KV_HEADS, DIM, 0.0, False)]


def family_table(paths: list[int], quick: bool) -> None:
    print("\n| decode, fp16 pool | rows x keys | " + " | ".join(cpu.ISA_NAMES[i] for i in [0] + paths) + " |")
    print("|---|---|" + "---|" * (len(paths) + 1))
    kv = KV_DTYPES["fp16"]
    for family, heads, kv_heads, d, softcap, sinks in FAMILY_HEADS:
        for n, keys in ((1, 2000),) if quick else ((1, 2000), (16, 1000)):
            slots = n * keys
            k_pool, v_pool = kv.encode(torch.randn(kv_heads, slots, d)), kv.encode(torch.randn(kv_heads, slots, d))
            q, table = torch.randn(n, heads * d), torch.randperm(slots).view(n, keys)
            sink = torch.randn(heads) if sinks else None
            times = [best_of(5, cpu.decode_attention, q, k_pool, v_pool, table, torch.arange(n), torch.full((n,), keys),
                             d ** -0.5, isa, 0, softcap, sink, True) for isa in [0] + paths]
            work = 4.0 * d * heads * keys * n
            print(f"| {family} | {n} x {keys} | " + " | ".join(
                f"{t * 1e3:.2f} ms, {work / t / 1e9:.0f} GFLOP/s" for t in times) + " |")


def main() -> None:
    args = kernel_bench_args()
    print()
    paths = list(range(1, cpu.best_isa() + 1)) or [0]  # the portable path is the reference, not a contender
    kv_types = KV_TYPES[:2] if args.quick else KV_TYPES
    extend_table(paths, SHAPES[1:3] if args.quick else SHAPES, kv_types)
    decode_table(paths, DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES, kv_types)
    family_table(paths, args.quick)


if __name__ == "__main__":
    main()
