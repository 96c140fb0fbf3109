"""The grammar backends (`--grammar-backend`) side by side on SmolLM2's vocabulary: what a request
waits for its constraint to compile, and what each step's token mask costs.

    python benchmarks/grammar_backends.py [--backends outlines,llguidance,xgrammar] [--quick]

Two workloads, each a few constraints and documents that satisfy them (tokenized as the model's
tokenizer writes them):

* json: json_decode.py's extraction schema (five fields, a bounded array), one document per person;
* tools: a tool-calling structural tag over three strict tools (`tool_calls.strict_tag`), each
  document free text around one `<tool_call>` block.

Per backend and workload:

* compile: submit to result through the runtime's GrammarCompiler (the compiler process, or the
  pool thread for an in-process backend), for constraints it has never seen (each a variant of the
  workload's, so nothing is cached), the compiler process already started; `first compile` is the
  backend's very first (a small regex), which starts that process and sends it the vocabulary;
* mask: `grammar_bitmask` for one step, every row constrained, batch 1 and batch 16 (16 requests
  at different places of different documents), mean and p99 over the documents' tokens;
* step: a row's own per-token bookkeeping besides the mask (advance by the sampled token, and the
  forced text jump-forward asks for), mean per row.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import cpu_info  # noqa: E402
from json_decode import CITIES, PEOPLE, SCHEMA  # noqa: E402
from radixlm.runtime import tool_calls  # noqa: E402
from radixlm.runtime.args import GRAMMAR_BACKENDS  # noqa: E402
from radixlm.runtime.constrained.grammar import GrammarCompiler, compiler_factory, grammar_bitmask  # noqa: E402

HOBBIES = ["chess", "running", "cooking", "go", "piano"]


def json_workload(variants: int, docs: int) -> tuple[list[tuple[str, str]], list[str]]:
    keys = []
    for v in range(variants):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"]["name"]["maxLength"] = 20 + v  # a different constraint: never cached
        keys.append(("json_schema", json.dumps(schema)))
    texts = [json.dumps({"name": PEOPLE[i % len(PEOPLE)], "age": 20 + i, "city": CITIES[i % len(CITIES)],
                         "is_student": i % 2 == 0, "hobbies": HOBBIES[: 1 + i % 3]}) for i in range(docs)]
    return keys, texts


def _tools(suffix: str) -> list[dict]:
    def tool(name: str, properties: dict) -> dict:
        return {"type": "function", "function": {"name": name + suffix, "strict": True, "parameters": {
            "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}

    return [tool("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
            tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
            tool("search", {"query": {"type": "string"}, "max_results": {"type": "integer"}})]


def tools_workload(variants: int, docs: int) -> tuple[list[tuple[str, str]], list[str]]:
    keys = [("structural_tag", tool_calls.strict_tag(_tools("" if v == 0 else f"_{v}"))) for v in range(variants)]
    calls = [lambda i: {"name": "get_weather", "arguments": {"city": CITIES[i % len(CITIES)], "unit": "celsius"}},
             lambda i: {"name": "add", "arguments": {"a": i, "b": 2 * i + 1}},
             lambda i: {"name": "search", "arguments": {"query": f"{HOBBIES[i % 5]} clubs in {CITIES[i % 5]}",
                                                        "max_results": 3}}]
    texts = [f"Sure, let me look that up for {PEOPLE[i % len(PEOPLE)]}.\n{tool_calls.OPEN}\n"
             f"{json.dumps(calls[i % 3](i))}\n{tool_calls.CLOSE}\nI will tell you what it says."
             for i in range(docs)]
    return keys, texts


def compile_wait(compiler: GrammarCompiler, key: tuple[str, str]) -> tuple[object, float]:
    start = time.perf_counter()
    compiler.submit(key)
    while (result := compiler.poll(key)) is None:
        select.select([compiler.ready_fd], [], [], 1.0)
        compiler.drain_ready()
    elapsed = time.perf_counter() - start
    if isinstance(result, Exception):
        raise SystemExit(f"{compiler.backend.name} refused {key[0]}: {result}")
    return result, elapsed


def mask_times(compiler: GrammarCompiler, grammar: object, docs: list[list[int]], batch: int,
               vocab: int) -> tuple[list[float], list[float]]:
    """Per step: the mask's seconds (every row constrained), and per row the rest of its bookkeeping."""
    masks, rest = [], []
    for first in range(0, len(docs), batch):
        group = docs[first : first + batch]
        if len(group) < batch:
            break
        matchers = [compiler.matcher(grammar) for _ in group]
        for m, doc in zip(matchers, group):
            assert m.accepts(doc), f"{compiler.backend.name} refuses a document of its own constraint"
        for step in range(min(len(d) for d in group)):
            start = time.perf_counter()
            grammar_bitmask(matchers, vocab)
            masks.append(time.perf_counter() - start)
            start = time.perf_counter()
            for m, doc in zip(matchers, group):
                m.advance(doc[step])
                m.forced()
            rest.append((time.perf_counter() - start) / batch)
    return masks, rest


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(GRAMMAR_BACKENDS))
    ap.add_argument("--quick", action="store_true", help="fewer constraints and documents (CI)")
    args = ap.parse_args()

    from radixlm.runtime.tokenizer.loader import load_tokenizer
    from radixlm.runtime.model_config import resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    variants, n_docs = (2, 16) if args.quick else (6, 48)
    workloads = {"json": json_workload(variants, n_docs), "tools": tools_workload(variants, n_docs)}
    encoded = {name: [tokenizer.encode(t, add_special_tokens=False) for t in texts]
               for name, (_, texts) in workloads.items()}
    model, features = cpu_info()
    print(f"CPU: {model}, {os.cpu_count()} cores, features: {' '.join(features) or '-'}")
    print(f"SmolLM2 vocabulary ({vocab} tokens); {variants} fresh constraints and {n_docs} documents per "
          "workload\n")
    header = ["backend", "workload", "first compile ms", "compile mean ms", "compile max ms", "mask b=1 mean us",
              "mask b=1 p99 us", "mask b=16 mean us", "mask b=16 p99 us", "step per row us"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for backend in args.backends.split(","):
        compiler = compiler_factory(tokenizer, vocab, [eos], 60.0, backend)()
        try:
            first = compile_wait(compiler, ("regex", "[0-9]+"))[1]  # starts the compiler process, if any
            for name, (keys, _) in workloads.items():
                compiled = [compile_wait(compiler, key) for key in keys]
                cold = [seconds for _, seconds in compiled]
                grammar = compiled[0][0]
                one, rest1 = mask_times(compiler, grammar, encoded[name], 1, vocab)
                many, rest16 = mask_times(compiler, grammar, encoded[name], 16, vocab)
                ms = [f"{1e3 * v:.1f}" for v in (first, statistics.mean(cold), max(cold))]
                us = [f"{1e6 * v:.0f}" for v in (statistics.mean(one), p99(one), statistics.mean(many), p99(many),
                                                 statistics.mean(rest1 + rest16))]
                print(f"| {backend} | {name} | " + " | ".join(ms + us) + " |", flush=True)
        finally:
            compiler.shutdown()


if __name__ == "__main__":
    main()
