"""`radixlm bench serve`: an online serving benchmark against a native or OpenAI-compatible endpoint.

Requests arrive as a Poisson process at `--request-rate` (inf: all at once), at
most `--max-concurrency` in flight; every request streams, so each token's
arrival is timed. Prompts are token ids (exact lengths, no tokenizer needed):
`random` draws input/output lengths around the given means; `shared-prefix`
puts a common prefix before each request's own tokens, as a system prompt or
few-shot block would (`--num-groups` N: N distinct prefixes, request i drawing
prefix i mod N, so the groups arrive interleaved). Outputs run to their length
(`ignore_eos`).

Reported: request and token throughput; TTFT (time to first token), TPOT
(time per output token after the first), ITL (gap between streamed chunks) and
end-to-end latency as mean / p50 / p90 / p99; and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def make_requests(dataset: str, num: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                  seed: int, vocab: int = 20000, num_groups: int = 1) -> list[Request]:
    """Deterministic synthetic requests: token ids in [100, vocab), lengths uniform within
    ±range_ratio of the means; shared-prefix: request i starts with prefix i % num_groups."""
    assert num_groups >= 1, num_groups
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    shared = dataset == "shared-prefix"
    prefixes = [[rng.randrange(100, vocab) for _ in range(prefix_len if shared else 0)] for _ in range(num_groups)]
    return [Request(prefixes[i % num_groups] + [rng.randrange(100, vocab) for _ in range(length(input_len))],
                    length(output_len))
            for i in range(num)]


async def _native(client: httpx.AsyncClient, req: Request) -> Outcome:
    body = {"input_ids": req.prompt, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True}}
    return await _stream(client, "/generate", body, native=True)


async def _openai(client: httpx.AsyncClient, req: Request, model: str) -> Outcome:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return await _stream(client, "/v1/completions", body, native=False)


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], native: bool) -> Outcome:
    out = Outcome(prompt_tokens=len(body.get("input_ids") or body.get("prompt")))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if native:  # each chunk has the ids so far (SGLang's stream), or only the new ones
                    meta = chunk["meta_info"]
                    new = meta["completion_tokens"] - out.output_tokens
                    out.output_tokens, out.cached_tokens = meta["completion_tokens"], meta["cached_tokens"]
                else:
                    usage = chunk.get("usage")
                    if usage:
                        out.output_tokens = usage["completion_tokens"]
                        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    new = sum(1 for c in chunk.get("choices", []) if c.get("text"))
                if not new:
                    continue
                if out.ttft == 0.0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
        out.latency = time.perf_counter() - start
        out.ok = out.output_tokens > 0
    except httpx.HTTPError as e:
        out.error = repr(e)
    return out


async def run(base_url: str, backend: str, requests: list[Request], rate: float, concurrency: int | None,
              model: str = "default", seed: int = 0) -> tuple[list[Outcome], float]:
    limit = asyncio.Semaphore(concurrency or len(requests))
    rng = np.random.default_rng(seed)
    # a fresh connection per request: servers close idle keep-alive connections on their own
    # schedule (llama-server after a few seconds), and a request sent on one being closed is lost
    limits = httpx.Limits(max_connections=concurrency or len(requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        async def one(req: Request) -> Outcome:
            async with limit:
                return await (_native(client, req) if backend == "native" else _openai(client, req, model))

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], duration: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.prompt_tokens for o in done)

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        a = np.asarray(values) * 1e3  # ms
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
                "p99": float(np.percentile(a, 99))}

    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    return {
        "completed": len(done), "failed": len(outcomes) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration, "input_tok_s": in_tokens / duration,
        "output_tok_s": out_tokens / duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "cache_hit_rate": sum(o.cached_tokens for o in done) / max(in_tokens, 1),
        "ttft_ms": stats([o.ttft for o in done]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for o in done for x in o.itl]), "e2e_ms": stats([o.latency for o in done]),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
    }


def table(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"completed {s['completed']} (failed {s['failed']}) in {s['duration_s']:.2f} s",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['input_tok_s']:.1f} input tok/s, "
        f"{s['output_tok_s']:.1f} output tok/s; prefix-cache hit rate {s['cache_hit_rate']:.1%}",
        f"{'ms':<6} | {'mean':>9} | {'p50':>9} | {'p90':>9} | {'p99':>9}",
    ]
    for key in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{key}_ms"]
        lines.append(f"{key.upper():<6} | {m['mean']:9.1f} | {m['p50']:9.1f} | {m['p90']:9.1f} | {m['p99']:9.1f}")
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=["native", "openai"], default="native",
                   help="native /generate, or OpenAI /v1/completions")
    p.add_argument("--model", default="default", help="the OpenAI `model` field")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform within ±this share of the mean")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: the common prefix's tokens")
    p.add_argument("--num-groups", type=int, default=1,
                   help="shared-prefix: distinct prefixes; request i gets prefix i mod N (groups interleaved)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=20000, help="prompt token ids are drawn from [100, this)")
    p.add_argument("--output-json", default=None, help="also write the summary here")


def main(ns: argparse.Namespace) -> int:
    if ns.num_groups < 1:
        raise SystemExit("--num-groups must be >= 1")
    if ns.vocab_size <= 100:
        raise SystemExit("--vocab-size must be > 100 (ids below 100 are left out: special tokens live there)")
    requests = make_requests(ns.dataset, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                             ns.prefix_len, ns.seed, vocab=ns.vocab_size, num_groups=ns.num_groups)
    outcomes, duration = asyncio.run(run(ns.base_url, ns.backend, requests, ns.request_rate, ns.max_concurrency,
                                         ns.model, ns.seed))
    summary = summarize(outcomes, duration)
    summary["config"] = {k: v for k, v in vars(ns).items() if k not in ("command", "bench_command")}
    print(table(summary))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1


