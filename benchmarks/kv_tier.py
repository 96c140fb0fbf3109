"""The KV tier (`--kv-tier-path`) on multi-turn agent traffic: with it against without, one run.

Sessions of an agent: a system prompt, then turns that each bring a tool's output and ask for a
short answer; a turn's prompt is the whole conversation so far. The sessions take turns round
robin, so between two turns of one session the others' traffic passes through a KV pool that
holds a quarter of the working set (every session's history at its longest): without the tier a
session's history is evicted by then and prefilled again; with it, read back from the folder.
Halfway through, the server restarts (the pool is lost; the tier's folder stays). It is served
(`Engine`: the runtime's processes, streaming as a client sees it); TTFT is the time to a
turn's first streamed token, tokens/s counts prompt and output tokens of all turns over the
time spent in turns (the restart's model loading aside). Both runs are greedy on the same
weights, so their answers should match.

    python benchmarks/kv_tier.py            # about 4 minutes on 2 cores
    python benchmarks/kv_tier.py --quick    # small sizes, no restart (CI: the script works)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from radixlm.runtime.engine import Engine  # noqa: E402
from radixlm.runtime.model_config import resolve_model  # noqa: E402
from radixlm.runtime.tokenizer.loader import chat_prompt, load_tokenizer  # noqa: E402

WORDS = ("order customer invoice shipped pending refund warehouse parcel courier address total item price "
         "quantity status delayed delivered returned discount coupon account balance payment card").split()


def tool_output(rng: random.Random, words: int) -> str:
    lines = []
    while sum(len(line.split()) for line in lines) < words:
        lines.append(f"#{rng.randrange(1000, 9999)} " + " ".join(rng.choice(WORDS) for _ in range(9)))
    return "\n".join(lines)


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    answers: list[str] = field(default_factory=list)
    tier: dict | None = None


def turn(engine: Engine, prompt: str, max_new: int, run: Run) -> str:
    start = time.perf_counter()
    first, text, meta = None, "", {}
    for chunk in engine.stream(prompt, {"max_new_tokens": max_new, "temperature": 0}):
        first = first or time.perf_counter()
        text += chunk["text"]
        meta = chunk["meta_info"]
    run.ttft.append(first - start)
    run.seconds += time.perf_counter() - start
    run.prompt_tokens += meta["prompt_tokens"]
    run.cached_tokens += meta["cached_tokens"]
    run.output_tokens += meta["completion_tokens"]
    return text


def run_traffic(make_engine, tokenizer, sessions: int, turns: int, words: int, max_new: int, restart: bool) -> Run:
    rng = random.Random(7)
    histories = [[{"role": "system", "content": f"You are agent {s}: you read tool outputs and answer in one line."}]
                 for s in range(sessions)]
    run = Run()
    engine = make_engine()
    for t in range(turns):
        if restart and t == turns // 2:  # a restart: the pool is lost, a tier's folder is not
            run.tier = engine.server_info()["kv_tier"]
            engine.shutdown()
            engine = make_engine()
        for history in histories:
            history.append({"role": "user", "content": f"Tool output:\n{tool_output(rng, words)}\n"
                                                        "Which order numbers are delayed?"})
            answer = turn(engine, chat_prompt(tokenizer, history), max_new, run)
            history.append({"role": "assistant", "content": answer})
            run.answers.append(answer)
    after = engine.server_info()["kv_tier"]
    if run.tier is not None and after is not None:  # the two servers' totals
        after = {k: run.tier[k] + after[k] for k in ("hits", "tokens_loaded", "bytes_written", "bytes_read",
                                                      "load_seconds")}
    run.tier = after
    engine.shutdown()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and no restart (CI: the script works)")
    args = ap.parse_args()
    restart = not args.quick  # (a restart is two more model loads: the tests restart a server of their own)
    sessions, turns, words, max_new = (4, 2, 40, 8) if args.quick else (8, 6, 120, 24)
    for line in measure(quick=args.quick).lines():
        print(line)
    tokenizer = load_tokenizer(resolve_model(None))
    # the working set: every session's prompt at its longest (the last turn), about; the pool
    # holds a quarter of it, but at least one whole conversation
    user = f"Tool output:\n{tool_output(random.Random(1), words)}\nWhich order numbers are delayed?"
    per_turn = len(tokenizer.encode(user)) + 12 + max_new  # (the template's own tokens: about 12 a turn)
    longest = 60 + turns * per_turn
    working_set = sessions * longest
    pool = max(working_set // 4, longest + 128)
    print(f"model: SmolLM2-135M-Instruct GGUF, served as by default; {sessions} sessions x {turns} turns, about "
          f"{per_turn} tokens a turn; working set about {working_set} tokens, KV pool {pool} tokens; "
          f"{'a restart before turn ' + str(turns // 2 + 1) if restart else 'no restart'}")
    folder = tempfile.mkdtemp(prefix="radixlm-kv-tier-")
    runs = {}
    for name, tier in (("without the tier", {}), ("with the tier", {"kv_tier_path": folder})):
        runs[name] = run_traffic(lambda: Engine(max_total_tokens=pool, **tier), tokenizer, sessions, turns, words,
                                 max_new, restart)
    print()
    print("| run | TTFT p50 ms | TTFT p90 ms | prompt tokens | cached | tokens/s | turns/s | same answers |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    off = runs["without the tier"]
    for name, r in runs.items():
        ttft = sorted(r.ttft)
        p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
        same = sum(a == b for a, b in zip(r.answers, off.answers))
        print(f"| {name} | {statistics.median(ttft) * 1e3:.0f} | {p90 * 1e3:.0f} | {r.prompt_tokens} | "
              f"{r.cached_tokens} | {(r.prompt_tokens + r.output_tokens) / r.seconds:.0f} | "
              f"{len(r.ttft) / r.seconds:.2f} | {same}/{len(r.answers)} |")
    on = runs["with the tier"]
    print()
    print(f"with the tier vs without: TTFT p50 {statistics.median(off.ttft) / statistics.median(on.ttft):.2f}x lower, "
          f"throughput {(on.prompt_tokens + on.output_tokens) / on.seconds / ((off.prompt_tokens + off.output_tokens) / off.seconds):.2f}x")
    if on.tier:
        print(f"tier: {on.tier['hits']} turns read {on.tier['tokens_loaded']} tokens back "
              f"({on.tier['bytes_read'] / 1e6:.0f} MB in {on.tier['load_seconds']:.2f} s); "
              f"{on.tier['bytes_written'] / 1e6:.0f} MB written")


if __name__ == "__main__":
    main()
