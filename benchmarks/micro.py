"""Micro-benchmarks: the radix cache's operations, the scheduler's own cost per step, this
machine's roofline against SmolLM2's decode step, and the sampler's cost per step.

    python benchmarks/micro.py            # --quick: small sizes (CI)

1. radix cache: match / insert / evict operations per second at 10k-100k tree nodes;
2. scheduler overhead per step with a fake worker (no model) at 1-512 running requests, and
   the radix cache's share of it with no sharing (run_all's no-sharing requests in a closed
   loop of 32, cache on against off);
3. roofline: measured memory bandwidth and fp32 matmul rate; SmolLM2's decode step at batch
   1 / 8 / 32 against the floor max(weight bytes / bandwidth, FLOPs / matmul rate);
4. sampler: building a step's sampling tensors and sampling [32, 49152] logits, per setting;
5. SGLang's native API: a stream's chunks holding everything so far against only what is new,
   and a `stop_regex` check per request per step.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from types import SimpleNamespace

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from radixlm.runtime.args import ServerArgs  # noqa: E402
from radixlm.runtime.cache.allocator import PageAllocator  # noqa: E402
from radixlm.runtime.cache.kv_pool import ReqToTokenTable  # noqa: E402
from radixlm.runtime.cache.radix_cache import RadixCache  # noqa: E402
from radixlm.runtime.messages import ClientOutput, TokenizedRequest  # noqa: E402
from radixlm.runtime.native import CumulativeStream, native_result  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.worker.model_worker import WorkerOutput  # noqa: E402
from radixlm.runtime.worker.sampler import Sampler, SamplingBatch  # noqa: E402


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# ---- 1. radix cache ----------------------------------------------------------------------------

def radix_rows(leaves: int, rng: random.Random) -> list[str]:
    """Insert `leaves` requests (64 shared trunks of 64 tokens + a 32-token own tail), then time
    matches (half hits), then evict everything."""
    trunks = [[rng.randrange(50000) for _ in range(64)] for _ in range(64)]
    seqs = [rng.choice(trunks) + [rng.randrange(50000) for _ in range(32)] for _ in range(leaves)]
    alloc = PageAllocator(leaves * 96 + 1024, 1)
    cache = RadixCache(alloc)

    def insert_all() -> None:
        for seq in seqs:
            m = cache.match_prefix(seq)
            cache.lock(m.node)
            slots = torch.cat([m.slots, alloc.alloc(len(seq) - len(m.slots))])
            cache.cache_request(seq, slots, len(m.slots), m.node)

    t_insert = timed(insert_all)
    nodes = cache._num_nodes
    t_snapshot = timed(cache.snapshot)  # the dashboard's tree: one walk, on request
    probes = [rng.choice(seqs) if i % 2 else rng.choice(trunks) + [1, 2, 3] for i in range(leaves)]
    t_match = timed(lambda: [cache.match_prefix(p) for p in probes])
    pages = cache.evictable_pages
    t_evict = timed(lambda: [cache.evict(64) for _ in range(pages // 64 + 1)])
    return [f"| {leaves} | {nodes} | {leaves / t_insert:,.0f} | {leaves / t_match:,.0f} | {pages / t_evict:,.0f} "
            f"| {t_snapshot * 1e3:.1f} |"]


# ---- 2. scheduler overhead -----------------------------------------------------------------------

class FakeWorker:
    """The scheduler's view of a worker, without a model: every request gets token 7."""

    def __init__(self, num_pages: int) -> None:
        self.device = torch.device("cpu")
        self.context_length = 4096
        self.config = SimpleNamespace(eos_token_ids=[2], vocab_size=49152)
        self.num_pages, self.page_size = num_pages, 1
        self.req_to_token = ReqToTokenTable(1024, self.context_length, self.device)
        self.loras: dict = {}  # the LoRA adapters served: none

    def forward(self, batch) -> WorkerOutput:
        return WorkerOutput(next_token_ids=[7] * len(batch.sample_rows))


def scheduler_rows(running: int, steps: int) -> list[str]:
    args = ServerArgs(max_running_requests=1024, chunked_prefill_size=1 << 20, max_prefill_tokens=1 << 20)
    sched = Scheduler(args, FakeWorker(running * 300 + 4096))
    rng = random.Random(running)
    for i in range(running):
        prompt = [rng.randrange(100, 30000) for _ in range(128)]
        sched.add_request(TokenizedRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=steps + 10, ignore_eos=True)))
    while sched.waiting or sched.chunked:  # admit and prefill everyone
        sched.step()
    assert len(sched.running) == running
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    per_step = (time.perf_counter() - start) / steps
    return [f"| {running} | {per_step * 1e3:.3f} | {per_step / running * 1e6:.1f} |"]


def churn_row(requests: int) -> str:
    """No sharing, 32 running, arrivals as others finish: the scheduler's time per step with
    the radix cache and without (the model step is the same: the batches are identical)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workloads import no_sharing

    work = no_sharing(requests)
    cells = []
    for disable in (False, True):
        args = ServerArgs(max_running_requests=32, disable_radix_cache=disable)
        sched = Scheduler(args, FakeWorker(65536))
        for i, (ids, n) in enumerate(work.requests):
            sched.add_request(TokenizedRequest(f"r{i}", ids, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        steps, start = 0, time.perf_counter()
        while sched.has_work:
            sched.step()
            steps += 1
        cells.append(((time.perf_counter() - start) / steps, steps))
    (on, steps_on), (off, steps_off) = cells
    assert steps_on == steps_off, (steps_on, steps_off)
    return f"| {requests} | {steps_on} | {on * 1e3:.3f} | {off * 1e3:.3f} | {(on - off) * 1e3:+.3f} |"


# ---- 3. roofline ----------------------------------------------------------------------------------

def roofline_rows(quick: bool) -> tuple[list[str], list[str]]:
    m = measure(quick)
    bandwidth, flops = m.bandwidth, m.matmul
    machine = [f"| CPU | {m.cpu}, {' '.join(m.features)} |",
               f"| memory bandwidth (copy) | {bandwidth / 1e9:.1f} GB/s |",
               f"| fp32 matmul ({512 if quick else 2048}², the faster kernel) | {flops / 1e9:.0f} GFLOP/s |"]
    from radixlm.runtime.local_engine import LocalEngine

    # fp32 weights (the table's title): the floor counts their parameters' bytes; no radix cache, so
    # every run prefills alike
    engine = LocalEngine(max_total_tokens=8192, disable_radix_cache=True, quantization="none")
    params = sum(p.numel() for p in engine.worker.model.parameters())
    weight_bytes = params * 4
    rows = []
    new = 8 if quick else 32
    for batch in ([1, 8] if quick else [1, 8, 32]):

        def run(tokens: int) -> float:
            ids = [[100 + i] * 64 for i in range(batch)]
            params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}
            return min(timed(lambda: engine.generate(input_ids=ids, sampling_params=params)) for _ in range(3))

        run(2)  # warm up
        # decode steps alone: a run of `new` tokens less a prefill-only run (each the best of 3: a
        # difference of two timings is at the mercy of the machine's other load)
        step = (run(new) - run(1)) / (new - 1)
        floor = max(weight_bytes / bandwidth, 2 * params * batch / flops)
        rows.append(f"| {batch} | {step * 1e3:.1f} | {floor * 1e3:.1f} | {step / floor:.2f}x |")
    return machine, rows


# ---- 4. sampler ----------------------------------------------------------------------------------

SAMPLER_CASES = {  # name -> (the row's params, tokens of context per row)
    "greedy": (lambda i: SamplingParams(temperature=0.0), 16),
    "temperature 0.8, top_k 50": (lambda i: SamplingParams(temperature=0.8, top_k=50), 16),
    "top_k 50 + top_p 0.9": (lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9), 16),
    "top_p 0.9 alone": (lambda i: SamplingParams(temperature=0.8, top_p=0.9), 16),
    "8 of the 32 seeded": (lambda i: SamplingParams(temperature=0.8, seed=i if i < 8 else None), 16),
    "repetition 1.1 + frequency 0.1": (
        lambda i: SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.1), 1000),
}


def sampler_rows(calls: int, rng: random.Random) -> list[str]:
    """Batch 32 at SmolLM2's vocabulary: a step's SamplingBatch.build and Sampler call, the best of
    `calls` (the machine's other load only ever adds)."""
    batch_size, vocab = 32, 49152
    logits = torch.randn(batch_size, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler, rows = Sampler(), []
    for name, (make, context) in SAMPLER_CASES.items():
        params = [make(i) for i in range(batch_size)]
        prompts = [[rng.randrange(vocab) for _ in range(context // 2)] for _ in range(batch_size)]
        outputs = [[rng.randrange(vocab) for _ in range(context // 2)] for _ in range(batch_size)]

        def build() -> SamplingBatch:
            return SamplingBatch.build(params, prompts, outputs, [2], vocab, "cpu")

        batch = build()
        sampler(logits, batch)  # warm up
        t_build = min(timed(build) for _ in range(calls))
        t_sample = min(timed(sampler, logits, batch) for _ in range(calls))
        rows.append(f"| {name} | {context} | {t_build * 1e3:.2f} | {t_sample * 1e3:.2f} |")
    return rows


# ---- 5. SGLang's native API ---------------------------------------------------------------------

def native_rows(tokens: int, calls: int) -> list[str]:
    """A `tokens`-token stream's chunks built and serialised (orjson, as the server sends them):
    deltas against SGLang's everything-so-far (`CumulativeStream`), the best of `calls`."""
    import orjson

    outs = [ClientOutput("r", " word", [1000 + i], {"id": "r", "prompt_tokens": 100, "completion_tokens": i + 1,
                                                     "cached_tokens": 0, "finish_reason": None}) for i in range(tokens)]

    def deltas() -> None:
        for o in outs:
            orjson.dumps(native_result(o))

    def cumulative() -> None:
        chunks = CumulativeStream()
        for o in outs:
            orjson.dumps(chunks.chunk(o))

    return [f"| stream chunks, {name} | {tokens} | {min(timed(fn) for _ in range(calls)) / tokens * 1e6:.1f} |"
            for name, fn in (("only what is new", deltas), ("everything so far", cumulative))]


def stop_regex_rows(calls: int) -> list[str]:
    """The scheduler's `stop_regex` check: decode a request's last n ids (SmolLM2's tokenizer),
    keep the last 256 characters, search; the mean of `calls`."""
    from radixlm.runtime.tokenizer.loader import load_tokenizer
    from radixlm.runtime.model_config import resolve_model

    tok = load_tokenizer(resolve_model(None), None)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    rows = []
    for n in (32, 256):
        tail = ids[-n:]

        def check() -> None:
            for _ in range(calls):
                re.search(r"\d{3}-\d{4}", tok.decode(tail, skip_special_tokens=False)[-256:])

        check()  # warm up
        rows.append(f"| stop_regex check | {n} | {timed(check) / calls * 1e6:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CI: proves the script works)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rng = random.Random(0)
    print(f"## Radix cache ({'quick' if args.quick else 'full'})\n")
    print("| requests | tree nodes | insert/s | match/s | evicted pages/s | snapshot ms |\n|---|---|---|---|---|---|")
    for leaves in ([1000] if args.quick else [10_000, 30_000, 100_000]):
        print(*radix_rows(leaves, rng), sep="\n")
    print("\n## Scheduler overhead per decode step (fake worker, no model)\n")
    print("| running | ms/step | µs/request |\n|---|---|---|")
    for running in ([1, 32] if args.quick else [1, 8, 32, 128, 512]):
        print(*scheduler_rows(running, 5 if args.quick else 30), sep="\n")
    print("\n## Radix cache overhead with no sharing (fake worker, 32 running, closed loop)\n")
    print("| requests | steps | ms/step cache on | ms/step cache off | difference ms |\n|---|---|---|---|---|")
    print(churn_row(32 if args.quick else 256))
    machine, rows = roofline_rows(args.quick)
    print("\n## This machine\n\n| measure | value |\n|---|---|", *machine, sep="\n")
    print("\n## SmolLM2-135M fp32 step time against the roofline floor\n")
    print("| batch | ms/step | floor ms | ratio |\n|---|---|---|---|", *rows, sep="\n")
    print("\n## Sampler per step (batch 32, vocabulary 49152)\n")
    print("| setting | context tokens | build ms | sample ms |\n|---|---|---|---|",
          *sampler_rows(3 if args.quick else 20, rng), sep="\n")
    print("\n## SGLang's native API, per chunk or per request per step\n")
    print("| what | tokens | µs |\n|---|---|---|", *native_rows(64 if args.quick else 512, 5),
          *stop_regex_rows(10 if args.quick else 200), sep="\n")


if __name__ == "__main__":
    main()
