"""Data parallelism: cache-aware routing against round robin over the same replicas, in one run.

    python benchmarks/router.py                      # 2 SmolLM2 replicas, 8 system prompts x 12 users
    python benchmarks/router.py --replicas 3 --groups 12 --users 8 --concurrency 24

Each request is one of `--groups` long system prompts (about 400 tokens) plus a
short user question, in a random order, `--concurrency` at a time. The replicas
are started once; before each policy their caches are flushed and a fresh router
is started over them. Reported per policy: wall time, requests/s, output
tokens/s, and the prefix-cache hit rate (cached / prompt tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.append(ROOT)  # after site-packages: kernels/ must not shadow the installed `kernels`
from radixlm.runtime.args import ServerArgs  # noqa: E402
from radixlm.runtime.launch import free_port, start_replica, wait_until_serving  # noqa: E402

TOPICS = ["gardening", "tax forms", "bicycle repair", "Italian cooking", "chess openings", "home networking",
          "birdwatching", "sourdough", "astronomy", "first aid", "knitting", "car insurance"]


def workload(groups: int, users: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    systems = [f"You are an expert on {TOPICS[g % len(TOPICS)]} (desk {g}). " + " ".join(
        f"Rule {i}: answer about {TOPICS[g % len(TOPICS)]} plainly, cite one fact, stay brief." for i in range(30))
        for g in range(groups)]
    prompts = [f"{systems[g]}\nUser {u}: what should a beginner know first? ({rng.randrange(10**6)})"
               for g in range(groups) for u in range(users)]
    rng.shuffle(prompts)
    return prompts


async def drive(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    totals = {"prompt": 0, "cached": 0, "output": 0}
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(text: str) -> None:
            async with sem:
                r = await client.post(url + "/generate", json={"text": text, "sampling_params": {
                    "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
                r.raise_for_status()
                meta = r.json()["meta_info"]
                totals["prompt"] += meta["prompt_tokens"]
                totals["cached"] += meta["cached_tokens"]
                totals["output"] += meta["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "req_per_s": len(prompts) / wall, "out_tok_per_s": totals["output"] / wall,
            "hit_rate": totals["cached"] / totals["prompt"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-args", default="--max-total-tokens 8192 --num-threads 1",
                    help="options of every replica (one torch thread each: the replicas share the cores)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(ns.server_args.split()))
    replicas = [start_replica(args) for _ in range(ns.replicas)]
    rows = {}
    try:
        for url, proc in replicas:
            wait_until_serving(url, proc)
        prompts = workload(ns.groups, ns.users, ns.seed)
        for policy in ("round_robin", "cache_aware"):
            for url, _ in replicas:
                httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
            port = free_port()
            router = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "router", "--policy", policy, "--port",
                                       str(port), "--worker-urls", *[u for u, _ in replicas]], cwd=ROOT)
            try:
                wait_until_serving(f"http://127.0.0.1:{port}", router, timeout=60)
                rows[policy] = asyncio.run(drive(f"http://127.0.0.1:{port}", prompts, ns.concurrency, ns.max_tokens))
            finally:
                router.terminate()
                router.wait(30)
    finally:
        for _, proc in replicas:
            proc.terminate()
        for _, proc in replicas:
            proc.wait(30)

    print(f"\n{ns.replicas} replicas, {len(prompts)} requests ({ns.groups} system prompts x {ns.users} users), "
          f"concurrency {ns.concurrency}, {ns.max_tokens} output tokens each\n")
    print("| policy | wall s | req/s | output tok/s | cache hit rate |")
    print("| --- | --- | --- | --- | --- |")
    for policy, r in rows.items():
        print(f"| {policy} | {r['wall_s']:.1f} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | {r['hit_rate']:.1%} |")
    rr, ca = rows["round_robin"], rows["cache_aware"]
    print(f"\ncache-aware / round robin: throughput {ca['req_per_s'] / rr['req_per_s']:.2f}x, "
          f"hit rate {ca['hit_rate']:.1%} vs {rr['hit_rate']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
