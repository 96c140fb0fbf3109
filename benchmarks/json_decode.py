"""Constrained JSON decoding against unconstrained decoding on the same prompts (SmolLM2, CPU).

    python benchmarks/json_decode.py [--requests 50] [--quick]

Prints tokens/s, batch steps (forward passes) and tokens per request for: JSON-schema constrained,
and unconstrained with the same prompts. (Jump-forward, when it lands, adds a
third row.) Both run in one process on one set of weights, so the ratio is
what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from runtime.local_engine import LocalEngine

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


def run(engine: LocalEngine, texts: list[str], params: dict) -> dict:
    steps = [0]
    forward = engine.worker.forward

    def counting(batch):
        steps[0] += 1
        return forward(batch)

    engine.worker.forward = counting
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(texts, params)
    wall = time.perf_counter() - start
    engine.worker.forward = forward
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    valid = sum(_valid(r["text"]) for r in results)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": steps[0], "valid_json": valid}


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
    engine.generate(texts[:1], {"max_new_tokens": 4, "json_schema": json.dumps(SCHEMA)})  # compile + warm up
    base = {"max_new_tokens": 128, "temperature": 0}
    rows = {
        "json_schema": run(engine, texts, {**base, "json_schema": json.dumps(SCHEMA)}),
        "unconstrained": run(engine, texts, base),
    }
    print(f"{n} requests, SmolLM2-135M fp32, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<14} | {'wall s':>7} | {'tokens':>6} | {'tok/s':>6} | {'batch steps':>11} | {'tokens/req':>10} | valid JSON")
    for name, r in rows.items():
        print(f"{name:<14} | {r['wall_s']:7.1f} | {r['tokens']:6d} | {r['tok_s']:6.1f} | {r['steps']:11d} | "
              f"{r['tokens'] / n:10.1f} | {r['valid_json']}/{n}")
    ratio = rows["json_schema"]["tok_s"] / rows["unconstrained"]["tok_s"]
    print(f"constrained / unconstrained tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
