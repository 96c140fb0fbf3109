"""Constrained JSON decoding against unconstrained decoding on the same prompts (SmolLM2, CPU).

    python benchmarks/json_decode.py [--requests 50] [--quick]

Prints tokens/s, batch steps, forward passes per request and tokens per request for:
JSON-schema constrained with jump-forward (forced text appended in one extend
step), constrained token by token, and unconstrained with the same prompts. All
run in one process on one set of weights, so the ratios are what to read.
The constrained pair runs twice: all requests at once (a batch of 50: a CPU
step is compute-bound there) and 10 of them one at a time (latency: a step of
one request costs about the same for 1 token or 10).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from radixlm.runtime.local_engine import LocalEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
        "is_student": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "is_student", "hobbies"],
}
PEOPLE = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo"]


def prompts(engine: LocalEngine, n: int) -> list[str]:
    out = []
    for i in range(n):
        bio = (f"{PEOPLE[i % len(PEOPLE)]} is {20 + i % 30} years old, lives in {CITIES[i % len(CITIES)]}, "
               f"{'studies' if i % 2 else 'works'} and likes chess, running and cooking.")
        msg = f"Extract name, age, city, is_student and hobbies as JSON from: {bio}"
        out.append(engine.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def run(engine: LocalEngine, texts: list[str], params: dict, jump_forward: bool = True,
        one_at_a_time: bool = False) -> dict:
    sched = engine.scheduler
    sched.jump_forward = jump_forward
    engine.flush_cache()
    steps, passes, jumped = sched.forward_passes, sched.request_passes, sched.jumped_tokens
    start = time.perf_counter()
    results = [engine.generate(t, params) for t in texts] if one_at_a_time else engine.generate(texts, params)
    wall = time.perf_counter() - start
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    valid = sum(_valid(r["text"]) for r in results)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": sched.forward_passes - steps,
            "passes": (sched.request_passes - passes) / len(texts), "jumped": sched.jumped_tokens - jumped,
            "valid_json": valid}


def _valid(text: str) -> bool:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(data, dict) and set(SCHEMA["required"]) <= set(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="8 requests")
    args = ap.parse_args()
    n = 8 if args.quick else args.requests
    torch.set_num_threads(os.cpu_count() or 1)
    engine = LocalEngine(max_total_tokens=60000)
    texts = prompts(engine, n)
    base = {"max_new_tokens": 128, "temperature": 0}
    constrained = {**base, "json_schema": json.dumps(SCHEMA)}
    run(engine, texts, constrained)  # warm up: compile the schema, find its forced texts
    solo = texts[:10]
    rows = {
        "json, jump-forward": run(engine, texts, constrained),
        "json, token by token": run(engine, texts, constrained, jump_forward=False),
        "unconstrained": run(engine, texts, base),
        "1-by-1 jump-forward": run(engine, solo, constrained, one_at_a_time=True),
        "1-by-1 token by token": run(engine, solo, constrained, jump_forward=False, one_at_a_time=True),
    }
    print(f"{n} requests, SmolLM2-135M fp32, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<21} | {'wall s':>6} | {'tokens':>6} | {'tok/s':>6} | {'batch steps':>11} | {'passes/req':>10} "
          f"| {'tokens/req':>10} | {'jumped':>6} | valid JSON")
    for name, r in rows.items():
        m = len(solo) if name.startswith("1-by-1") else n
        print(f"{name:<21} | {r['wall_s']:6.1f} | {r['tokens']:6d} | {r['tok_s']:6.1f} | {r['steps']:11d} | "
              f"{r['passes']:10.1f} | {r['tokens'] / m:10.1f} | {r['jumped']:6d} | {r['valid_json']}/{m}")
    jf, tbt, free, jf1, tbt1 = rows.values()
    for label, a, b in (("batch", jf, tbt), ("one at a time", jf1, tbt1)):
        print(f"jump-forward / token by token, {label}: tokens/s {a['tok_s'] / b['tok_s']:.2f}x, "
              f"wall {b['wall_s'] / a['wall_s']:.2f}x faster, passes/req {a['passes'] / b['passes']:.2f}x")
    print(f"constrained / unconstrained tokens/s: jump-forward {jf['tok_s'] / free['tok_s']:.2f}x, "
          f"token by token {tbt['tok_s'] / free['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
