"""What one step costs: decode at batch 1-64 against the roofline, and a decode batch with prefill
riding on it (chunked prefill), by the prefill tokens added. The second table is how the
default step budget (`--chunked-prefill-size`) was chosen: each prefill token a step carries
delays every running request's next token by its cost. Last, the radix cache's cost when
nothing is shared: one workload, cache on and off, alternated in one run.

    python benchmarks/step_cost.py            # about 6 minutes on 2 cores
    python benchmarks/step_cost.py --quick    # small sizes (CI: the script works)

Steps are timed on the scheduler (`Scheduler.step`, model, sampling and bookkeeping
included), best of several, on SmolLM2-135M fp32 with 128-token contexts. FLOPs count the
weights' multiply-adds (2 x parameters per token) and attention's (4 x layers x heads x
head_dim per key).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import best_of, measure  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402
from radixlm.runtime.messages import TokenizedRequest  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime.worker import quant  # noqa: E402

CONTEXT = 128


class Bench:
    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        cfg = engine.worker.config
        self.params = quant.parameter_count(engine.worker.model)
        self.attn_per_key = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
        self.rng = random.Random(0)
        self.n = 0

    def add(self, prompt_len: int, max_new: int = 400) -> str:
        rid = f"r{self.n}"
        self.n += 1
        prompt = [self.rng.randrange(100, 20000) for _ in range(prompt_len)]
        self.sched.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True,
                                                                            temperature=0)))
        return rid

    def decoding(self, batch: int) -> list[str]:
        """`batch` requests, prefilled and decoding."""
        rids = [self.add(CONTEXT) for _ in range(batch)]
        while self.sched.waiting or self.sched.chunked:
            self.sched.step()
        return rids

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            self.sched.abort(rid)

    def step_time(self, tries: int) -> float:
        return best_of(tries, self.sched.step)

    def prompt_step_time(self, prompt_len: int, tries: int) -> float:
        """The best step with a fresh `prompt_len`-token prompt riding on it (it then ends)."""
        best = float("inf")
        for _ in range(tries):
            rid = self.add(prompt_len, max_new=1)
            best = min(best, best_of(1, self.sched.step))
            self.drop([rid])
        return best

    def flops(self, tokens: int, keys: int) -> float:
        return 2 * self.params * tokens + self.attn_per_key * keys


def decode_rows(b: Bench, batches: list[int], matmul: float, tries: int) -> list[str]:
    rows = []
    for batch in batches:
        rids = b.decoding(batch)
        b.step_time(2)  # warm
        t = b.step_time(tries)
        rate = b.flops(batch, batch * (CONTEXT + 4)) / t
        rows.append(f"| {batch} | {t * 1e3:.1f} | {batch / t:.0f} | {rate / 1e9:.0f} | {rate / matmul:.0%} |")
        b.drop(rids)
    return rows


def mixed_rows(b: Bench, decoders: int, prefills: list[int], tries: int) -> list[str]:
    rids = b.decoding(decoders)
    b.step_time(2)
    base = b.step_time(tries)
    rows = [f"| {decoders} | 0 | {base * 1e3:.1f} | - | 1.00x |"]
    for p in prefills:
        best = b.prompt_step_time(p, tries)
        rows.append(f"| {decoders} | {p} | {best * 1e3:.1f} | {(best - base) / p * 1e3:.2f} | {best / base:.2f}x |")
    b.drop(rids)
    return rows


def deterministic_rows(engine: LocalEngine, decoders: int, prefill: int, tries: int) -> list[str]:
    """What --deterministic costs: a decode step of `decoders`, and one with a `prefill`-token prompt
    riding on it, default against batch-invariant, on one copy of the weights."""
    rows = []
    for name, deterministic in (("default", False), ("--deterministic", True)):
        e = LocalEngine(model=engine.worker.model, skip_tokenizer_init=True, max_total_tokens=40000,
                        deterministic=deterministic, quantization=engine.args.quantization)
        b = Bench(e)
        rids = b.decoding(decoders)
        b.step_time(2)
        decode = b.step_time(tries)
        best = b.prompt_step_time(prefill, tries)
        b.drop(rids)
        e.shutdown()
        rows.append((name, decode, best))
    base = rows[0]
    return [f"| {name} | {d * 1e3:.1f} | {d / base[1]:.2f}x | {m * 1e3:.1f} | {m / base[2]:.2f}x |" for name, d, m in rows]


def radix_overhead_rows(engine: LocalEngine, requests: int, rounds: int, new: int = 64) -> list[str]:
    """The same no-sharing workload (random 128-token prompts, `new` greedy tokens each, all at once)
    on engines over one copy of the weights, radix cache on and off, alternated `rounds` times:
    what the cache costs when nothing is shared."""
    on, off = (LocalEngine(model=engine.worker.model, skip_tokenizer_init=True, max_total_tokens=40000,
                           disable_radix_cache=disable, quantization=engine.args.quantization)
               for disable in (False, True))
    rng = random.Random(1)
    times: dict[str, list[float]] = {"on": [], "off": []}
    params = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0}
    for _ in range(rounds):
        for name, e in (("on", on), ("off", off)):
            prompts = [[rng.randrange(100, 20000) for _ in range(CONTEXT)] for _ in range(requests)]
            start = time.perf_counter()
            e.generate(input_ids=prompts, sampling_params=params)
            times[name].append(time.perf_counter() - start)
    on.shutdown()
    off.shutdown()
    on_s, off_s = sorted(times["on"])[rounds // 2], sorted(times["off"])[rounds // 2]
    return [f"| {requests} | {rounds} | {' / '.join(f'{t:.2f}' for t in times['on'])} | "
            f"{' / '.join(f'{t:.2f}' for t in times['off'])} | {on_s / off_s - 1:+.1%} |"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--quantization", default="none", help="the weights (default none: fp32, which the rate column is of)")
    args = ap.parse_args()
    machine = measure(args.quick)
    print("\n".join(machine.lines()))
    engine = LocalEngine(max_total_tokens=40000, chunked_prefill_size=4096, max_prefill_tokens=4096,
                         quantization=args.quantization)
    b = Bench(engine)
    tries = 2 if args.quick else 5
    print("\nDecode steps (128-token contexts):\n")
    print("| batch | ms/step | tok/s | GFLOP/s | of fp32 matmul rate |")
    print("|---|---|---|---|---|")
    print("\n".join(decode_rows(b, [1, 8] if args.quick else [1, 8, 32, 64], machine.matmul, tries)))
    decoders = 8 if args.quick else 32
    print(f"\nA step of {decoders} decoders with a prompt riding on it:\n")
    print("| decoders | prefill tokens | ms/step | ms per prefill token | vs decode alone |")
    print("|---|---|---|---|---|")
    print("\n".join(mixed_rows(b, decoders, [64, 256] if args.quick else [32, 64, 128, 256, 512, 1024, 2048], tries)))
    print(f"\nWhat --deterministic costs ({decoders} decoders; a {decoders}-decoder step with a 224-token prompt):\n")
    print("| mode | decode ms/step | vs default | with prefill ms/step | vs default |")
    print("|---|---|---|---|---|")
    print("\n".join(deterministic_rows(engine, decoders, 64 if args.quick else 224, tries)))
    print("\nRadix cache overhead with no sharing (wall s per run, alternated; the difference of the medians):\n")
    print("| requests | rounds | cache on s | cache off s | on / off - 1 |")
    print("|---|---|---|---|---|")
    print("\n".join(radix_overhead_rows(engine, 4 if args.quick else 32, 1 if args.quick else 5, 16 if args.quick else 64)))
    engine.shutdown()


if __name__ == "__main__":
    main()
