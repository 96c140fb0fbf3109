"""Speculative decoding: tokens per second with each --speculative method against off, one run.

Workloads, each run on a fresh engine per method (the same weights, served as by default):
- one stream on repetitive work, requests one after another: a JSON extraction that copies
  values from its prompt, code editing (a file rewritten with one change), and a multi-turn
  agent whose turns restate the tool outputs they were given;
- one stream on the no-sharing random workload (random prompts, fixed-length outputs);
- 32 streams of the no-sharing workload (64 requests, 32 decoding at once).
Greedy, so every method should write the same text; the table says where it did not (without
--deterministic a verify row runs other kernels than a decode row, so a near-tie may flip).
The ratio is tokens/s over `off` in the same run; acceptance is the drafts kept of those checked.

`draft` is a draft model: there is no smaller model of SmolLM2's vocabulary on this machine, so it
is SmolLM2's own first `--draft-layers` layers with its final norm and head (an early-exit
draft; the served weights shared, no copy), given to the runtime as a draft model of its own.

    python benchmarks/speculative.py            # about 4 minutes on 2 cores
    python benchmarks/speculative.py --quick    # small sizes (CI: the script works)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from benchmarks.workloads import no_sharing  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402

METHODS = ("off", "ngram", "radix", "auto", "draft")

BIOS = [
    "Maria Lopez, 29, is a nurse at Saint Anne Hospital in Valencia. She speaks Spanish, English and Catalan, "
    "rides her bike to work, plays the violin in the Valencia Youth Orchestra and volunteers at the food bank.",
    "Kenji Watanabe, 41, is a civil engineer at Tokyo Metro Works in Osaka. He speaks Japanese and English, "
    "collects vintage cameras, runs marathons and teaches origami at the Osaka Community Center on Sundays.",
    "Amara Okafor, 35, is a data analyst at Lagos Fintech Partners in Lagos. She speaks English, Igbo and "
    "French, writes a blog about urban gardening, plays chess online and coaches the Lekki girls' football team.",
    "Lukas Becker, 52, is a carpenter at Becker und Sohn Holzbau in Freiburg. He speaks German and Italian, "
    "restores old furniture, keeps bees in the Black Forest and sings bass in the Freiburg Cathedral choir.",
]

CODE = '''def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            order_id, customer, amount = line.strip().split(",")
            orders.append({"id": order_id, "customer": customer, "amount": float(amount)})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals


def largest_orders(orders, n):
    return sorted(orders, key=lambda order: order["amount"], reverse=True)[:n]
'''

EDITS = ["Rename the function load_orders to read_orders everywhere. Output the whole file.",
         "Change the parameter name n to count in largest_orders. Output the whole file.",
         "Add a docstring to total_by_customer. Output the whole file.",
         "Rename the variable totals to sums. Output the whole file."]

TOOL_OUTPUTS = [
    "orders: #1041 Alice 3 x espresso beans 250g; #1042 Bob 1 x grinder model K2; #1043 Alice 2 x filter papers",
    "weather: Paris 14C light rain; Lyon 17C cloudy; Nice 21C sunny; Lille 11C showers",
    "flights: AF 1234 Paris-Rome 08:15 gate K32; AZ 317 Rome-Paris 19:40 gate B12; AF 1502 Paris-Nice 12:05 gate F4",
]


@dataclass
class Row:
    workload: str
    method: str
    tokens: int
    seconds: float
    texts: list[str]
    proposed: int
    accepted: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def chat(engine: LocalEngine, messages: list[dict]) -> str:
    return engine.apply_chat_template(messages)


def one_stream(engine: LocalEngine, prompts: list, max_new: int, ignore_eos: bool = False) -> tuple[int, list[str]]:
    """Requests one after another (the next is sent when the last ends): tokens made, texts."""
    tokens, texts = 0, []
    for p in prompts:
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": ignore_eos}
        r = engine.generate(p, params) if isinstance(p, str) else engine.generate(input_ids=p, sampling_params=params)
        tokens += r["meta_info"]["completion_tokens"]
        texts.append(r["text"] if "text" in r else str(r["output_ids"]))
    return tokens, texts


def agent(engine: LocalEngine, sessions: int, turns: int, max_new: int) -> tuple[int, list[str]]:
    """Multi-turn sessions: each turn gets a tool output and answers by restating it; the history grows."""
    tokens, texts = 0, []
    for s in range(sessions):
        messages = [{"role": "system", "content": "You are an assistant that reports tool results to the user."}]
        for t in range(turns):
            tool = TOOL_OUTPUTS[(s + t) % len(TOOL_OUTPUTS)]
            messages.append({"role": "user", "content": f"The tool returned: {tool}\nRepeat every item of it "
                                                        f"to me as a bulleted list, word for word."})
            r = engine.generate(chat(engine, messages), {"max_new_tokens": max_new, "temperature": 0})
            tokens += r["meta_info"]["completion_tokens"]
            texts.append(r["text"])
            messages.append({"role": "assistant", "content": r["text"]})
    return tokens, texts


def run(workload: str, engine: LocalEngine, quick: bool) -> tuple[int, list[str]]:
    n = 2 if quick else 4
    if workload == "json extraction":
        prompts = [chat(engine, [{"role": "user", "content": f"Extract name, age, job, employer, city, languages and "
                                                             f"hobbies as a JSON object from: {b}"}]) for b in BIOS[:n]]
        return one_stream(engine, prompts, 48 if quick else 160)
    if workload == "code editing":
        prompts = [chat(engine, [{"role": "user", "content": f"{CODE}\n{e}"}]) for e in EDITS[:n]]
        return one_stream(engine, prompts, 48 if quick else 200)
    if workload == "agent turns":
        return agent(engine, 1 if quick else 2, 2 if quick else 3, 48 if quick else 96)
    if workload == "random 1 stream":
        w = no_sharing(2 if quick else 6, seed=5)
        return one_stream(engine, [ids for ids, _ in w.requests], 32 if quick else 96, ignore_eos=True)
    w = no_sharing(8 if quick else 64, seed=11)  # random 32 streams
    params = [{"max_new_tokens": o if not quick else 16, "temperature": 0, "ignore_eos": True} for _, o in w.requests]
    results = engine.generate(input_ids=[ids for ids, _ in w.requests], sampling_params=params)
    return sum(r["meta_info"]["completion_tokens"] for r in results), [str(r["output_ids"]) for r in results]


def early_exit_draft(model: torch.nn.Module, layers: int, folder: str) -> tuple[str, torch.nn.Module]:
    """The target's first `layers` layers, its final norm and head as a draft model: a checkpoint
    folder with its config (the runtime reads the draft's shape from it) and the module, which
    shares the target's served weights."""
    cfg = model.cfg
    config = {"architectures": [cfg.architecture], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
              "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
              "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    draft = copy.copy(model)  # a new module object whose children are the target's (the first layers only)
    draft._modules = dict(model._modules)
    draft.layers = torch.nn.ModuleList(model.layers[:layers])
    return folder, draft


WORKLOADS = ("json extraction", "code editing", "agent turns", "random 1 stream", "random 32 streams")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens")
    ap.add_argument("--draft-layers", type=int, default=6, help="layers of the early-exit draft model")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "off":
        methods.insert(0, "off")
    for line in measure(quick=args.quick).lines():
        print(line)
    base = LocalEngine(max_running_requests=32)
    model, tokenizer = base.worker.model, base.tokenizer
    print(f"model: SmolLM2-135M-Instruct GGUF, served as {base.worker.quantization.method}; "
          f"--speculative-num-draft-tokens {args.num_draft_tokens}; draft: its first {args.draft_layers} layers")
    draft_path, draft = early_exit_draft(model, args.draft_layers, tempfile.mkdtemp(prefix="radixlm-draft-"))
    rows: list[Row] = []
    for workload in args.workloads.split(","):
        for method in methods:
            drafting = dict(speculative_draft_model=draft_path, draft_model=draft) if method == "draft" else {}
            engine = LocalEngine(model=model, tokenizer=tokenizer, max_running_requests=32, speculative=method,
                                 speculative_num_draft_tokens=args.num_draft_tokens, **drafting)
            engine.generate("Hello", {"max_new_tokens": 4})  # warm: the first step's one-time costs
            engine.flush_cache()
            start = time.perf_counter()
            tokens, texts = run(workload, engine, args.quick)
            seconds = time.perf_counter() - start
            spec = engine.scheduler.speculator
            stats = spec.stats() if spec else {"proposed_tokens": 0, "accepted_tokens": 0}
            rows.append(Row(workload, method, tokens, seconds, texts, stats["proposed_tokens"], stats["accepted_tokens"]))
    print()
    print("| workload | method | tokens | tokens/s | vs off | drafts checked | kept | same text as off |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for workload in args.workloads.split(","):
        off = next(r for r in rows if r.workload == workload and r.method == "off")
        for r in (r for r in rows if r.workload == workload):
            same = sum(a == b for a, b in zip(r.texts, off.texts))
            kept = f"{r.accepted / r.proposed:.0%}" if r.proposed else "-"
            print(f"| {workload} | {r.method} | {r.tokens} | {r.rate:.1f} | {r.rate / off.rate:.2f}x | {r.proposed} | "
                  f"{kept} | {same}/{len(r.texts)} |")


if __name__ == "__main__":
    main()
