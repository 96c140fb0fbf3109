"""Overlap scheduling on this CPU: decode throughput with the next step built while the model runs
(`--overlap-schedule on`) against one step at a time (`off`), and the scheduler's share of a
step, the most overlap can hide.

Two engines over one copy of the embedded SmolLM2 (as served: `--quantization auto`), the same
workload on each, alternated for several rounds (the median kept): B requests of 128 random
prompt tokens decode 64 tokens each, greedy, all submitted at once. "scheduler" is the step
minus the worker's forward pass, timed on the `off` engine: everything overlap moves beside the
forward pass.

    python benchmarks/overlap.py            # about 3 minutes on 2 cores
    python benchmarks/overlap.py --quick    # small sizes (CI: the script works)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402

CONTEXT = 128


def workload(batch: int, new_tokens: int, seed: int) -> tuple[list[list[int]], dict]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(CONTEXT)] for _ in range(batch)]
    return prompts, {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}


def scheduler_share(engine: LocalEngine, batch: int, new_tokens: int) -> tuple[float, float]:
    """Per decode step of the `off` engine: (ms in the worker's forward, ms in the rest of `step`)."""
    worker, spent = engine.worker, [0.0]
    real = worker.forward

    def timed(b):
        start = time.perf_counter()
        try:
            return real(b)
        finally:
            spent[0] += time.perf_counter() - start

    worker.forward = timed
    prompts, params = workload(batch, new_tokens, seed=99)
    sched = engine.scheduler
    from radixlm.runtime.messages import TokenizedRequest
    from radixlm.runtime.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        sched.add_request(TokenizedRequest(f"share{i}", p, SamplingParams.from_dict(params)))
    while sched.waiting or sched.chunked:
        sched.step()
    spent[0], steps, start = 0.0, 0, time.perf_counter()
    while sched.has_work:
        sched.step()
        steps += 1
    total = time.perf_counter() - start
    worker.forward = real
    return spent[0] / steps * 1e3, (total - spent[0]) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    args = ap.parse_args()
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,32")).split(",")]
    new_tokens, rounds = (8, 1) if args.quick else (64, 3)
    machine = measure(quick=args.quick)
    off = LocalEngine(skip_tokenizer_init=True, max_total_tokens=20000, overlap_schedule="off")
    on = LocalEngine(model=off.worker.model, skip_tokenizer_init=True, max_total_tokens=20000, overlap_schedule="on")
    print("\n".join(machine.lines()))
    print(f"model: SmolLM2-135M, served {off.worker.quantization.method}; {CONTEXT}-token prompts, "
          f"{new_tokens} new tokens each, median of {rounds} alternated rounds\n")
    print("| batch | off tokens/s | on tokens/s | on / off | forward ms/step | scheduler ms/step | scheduler share |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds + 1):  # the first round warms both
            for name, engine in (("off", off), ("on", on)):
                prompts, params = workload(batch, new_tokens, seed=r)
                engine.flush_cache()
                start = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=params)
                if r:
                    times[name].append(time.perf_counter() - start)
        rate = {name: batch * new_tokens / statistics.median(t) for name, t in times.items()}
        forward, rest = scheduler_share(off, batch, new_tokens)
        print(f"| {batch} | {rate['off']:.1f} | {rate['on']:.1f} | {rate['on'] / rate['off']:.2f}x | "
              f"{forward:.1f} | {rest:.2f} | {rest / (forward + rest):.1%} |")
    assert on.scheduler.overlapped_steps > 0, "the on engine never overlapped a step"
    off.shutdown()
    on.shutdown()


if __name__ == "__main__":
    main()
