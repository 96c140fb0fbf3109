"""Offline throughput: radixlm's engine against `transformers` static batching, same weights, same process.

Two workloads, every request greedy and forced to its full length:

- random: prompts of random vocabulary tokens (90-110 long, fixed seed), 128 new tokens each.
- shared-prefix: one 1,000-token random "document" shared by every prompt, then a
  different 15-25-token random "question" each; 64 new tokens each.

Systems: our engine with every request submitted at once (continuous batching),
with and without the radix cache, and HF `generate` in static left-padded
batches of 32. Timings on a shared CPU are noisy, so both systems run in the
same process, back to back, and the table reports their ratio.

    python benchmarks/offline_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`

from radixlm.runtime.local_engine import LocalEngine  # noqa: E402
from radixlm.runtime.tokenizer.loader import load_tokenizer  # noqa: E402
from radixlm.runtime.model_config import default_model_path, resolve_model  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HF = "hf-static"


@dataclass(frozen=True)
class Config:
    requests: int
    random_lens: tuple[int, int]  # prompt length range of the random workload
    random_new_tokens: int
    prefix_len: int
    question_lens: tuple[int, int]
    prefix_new_tokens: int
    hf_batch: int


FULL = Config(requests=64, random_lens=(90, 110), random_new_tokens=128, prefix_len=1000,
              question_lens=(15, 25), prefix_new_tokens=64, hf_batch=32)
# Same shape, small enough for a smoke run; hf_batch < requests so HF still runs several batches.
QUICK = Config(requests=8, random_lens=(90, 110), random_new_tokens=16, prefix_len=200,
               question_lens=(15, 25), prefix_new_tokens=16, hf_batch=4)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    new_tokens: int

    @property
    def total_tokens(self) -> int:
        return sum(len(p) + self.new_tokens for p in self.prompts)


@dataclass
class Row:
    workload: str
    system: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    cached_tokens: int | None  # None for HF, which has no prefix cache
    ratio_vs_hf: float | None = None

    @property
    def output_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s


# ---- workloads ---------------------------------------------------------------------------------


def token_pool(tokenizer: Any) -> list[int]:
    """Every id except the special ones, so no prompt contains an <|im_end|> or the like."""
    special = set(tokenizer.all_special_ids)
    return [t for t in range(len(tokenizer)) if t not in special]


def random_workload(pool: list[int], cfg: Config, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [rng.choices(pool, k=rng.randint(*cfg.random_lens)) for _ in range(cfg.requests)]
    return Workload("random", prompts, cfg.random_new_tokens)


def shared_prefix_workload(pool: list[int], cfg: Config, seed: int = 1) -> Workload:
    rng = random.Random(seed)
    document = rng.choices(pool, k=cfg.prefix_len)
    prompts = [document + rng.choices(pool, k=rng.randint(*cfg.question_lens)) for _ in range(cfg.requests)]
    return Workload("shared-prefix", prompts, cfg.prefix_new_tokens)


# ---- the two systems ---------------------------------------------------------------------------


def run_ours(engine: LocalEngine, w: Workload, system: str) -> tuple[Row, list[list[int]]]:
    """Every request submitted at once: the scheduler batches them continuously."""
    engine.flush_cache()  # cold cache: the first request of the run populates it
    # min_new_tokens matches HF's semantics exactly (EOS is masked, not just ignored), so the
    # greedy outputs are comparable token for token.
    params = {"max_new_tokens": w.new_tokens, "min_new_tokens": w.new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    results = engine.generate(input_ids=w.prompts, sampling_params=params)
    wall = time.perf_counter() - start
    outputs = [r["output_ids"] for r in results]
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    return _row(w, system, wall, outputs, cached), outputs


@torch.inference_mode()
def run_hf(model: Any, w: Workload, batch_size: int, pad_id: int) -> tuple[Row, list[list[int]]]:
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(w.prompts), batch_size):
        outputs.extend(hf_generate(model, w.prompts[i : i + batch_size], w.new_tokens, pad_id))
    wall = time.perf_counter() - start
    return _row(w, f"{HF}-{batch_size}", wall, outputs, None), outputs


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """One static batch: left-padded so every prompt ends at the same column."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id)
    return out[:, width:].tolist()


def _row(w: Workload, system: str, wall: float, outputs: list[list[int]], cached: int | None) -> Row:
    return Row(w.name, system, len(w.prompts), sum(map(len, w.prompts)), sum(map(len, outputs)), wall, cached)


def load_hf(path: str) -> Any:
    from radixlm.runtime.hf_reference import load_hf_model

    return load_hf_model(path)


def warm_up(engine: LocalEngine, hf: Any, pad_id: int) -> None:
    """One tiny generate each, so first-call costs (allocations, kernel selection) stay out of the timings."""
    prompt = [[100] * 8, [200] * 12]
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})
    hf_generate(hf, prompt, 4, pad_id)
    engine.flush_cache()


# ---- reporting -----------------------------------------------------------------------------------


def set_ratios(rows: list[Row]) -> None:
    """Output tokens/s of each row over the HF row of its workload (the work is identical)."""
    base = {r.workload: r.output_tok_s for r in rows if r.system.startswith(HF)}
    for r in rows:
        r.ratio_vs_hf = r.output_tok_s / base[r.workload] if r.workload in base else None


def count_matches(ours: list[list[int]], ref: list[list[int]]) -> tuple[int, int]:
    """(requests whose outputs are identical, of which among the first 4)."""
    same = [a == b for a, b in zip(ours, ref)]
    return sum(same), sum(same[:4])


def print_table(rows: list[Row]) -> None:
    head = ("workload", "system", "reqs", "prompt tok", "gen tok", "wall s", "out tok/s", "total tok/s",
            "vs HF", "cached tok")
    lines = [head] + [
        (r.workload, r.system, str(r.requests), str(r.prompt_tokens), str(r.generated_tokens), f"{r.wall_s:.1f}",
         f"{r.output_tok_s:.1f}", f"{r.total_tok_s:.1f}",
         f"{r.ratio_vs_hf:.2f}x" if r.ratio_vs_hf is not None else "-",
         str(r.cached_tokens) if r.cached_tokens is not None else "-")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for n, line in enumerate(lines):
        print(" | ".join(cell.ljust(wd) for cell, wd in zip(line, widths)))
        if n == 0:
            print("-+-".join("-" * wd for wd in widths))


def save_json(rows: list[Row], meta: dict[str, Any], quick: bool) -> None:
    # a smoke run gets its own file so that it never overwrites the full run's numbers
    path = os.path.join(RESULTS_DIR, "offline_throughput_quick.json" if quick else "offline_throughput.json")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    payload = {**meta, "rows": [asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s}
                                for r in rows]}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


# ---- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens, 200-token prefix: a smoke run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for both systems (default: every core)")
    cli = parser.parse_args()
    cfg = QUICK if cli.quick else FULL
    # Both systems share one setting, so neither is favoured. NOTE: if another process is busy on
    # these cores, every-core OpenMP threads wait on each other and both systems slow down many-fold.
    torch.set_num_threads(cli.threads)
    load_before = os.getloadavg()[0]

    path = default_model_path()
    tokenizer = load_tokenizer(resolve_model(path))
    pool = token_pool(tokenizer)
    workloads = [random_workload(pool, cfg), shared_prefix_workload(pool, cfg)]
    # Room for every request at once, so our runs measure batching, not retraction under a small pool.
    kv_tokens = max(w.total_tokens for w in workloads) + 1024
    # fp32 weights, as HF's: the outputs-identical count compares the same arithmetic
    ours = LocalEngine(path, tokenizer=tokenizer, max_total_tokens=kv_tokens, quantization="none")
    hf = load_hf(path)
    warm_up(ours, hf, tokenizer.eos_token_id)

    rows, matches = run_all(ours, hf, workloads, cfg)
    set_ratios(rows)
    print_table(rows)
    load_after = os.getloadavg()[0]
    print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after "
          f"({cli.threads} threads; a higher load means others shared the cores)")
    print(f"random workload: {matches[0]}/{cfg.requests} outputs identical to HF ({matches[1]}/4 of the first four)")
    save_json(rows, {
        "mode": "quick" if cli.quick else "full", "config": asdict(cfg), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "load_avg_1min": [load_before, load_after],
        "random_exact_matches": matches[0], "random_first4_matches": matches[1],
    }, cli.quick)


def run_all(ours: LocalEngine, hf: Any, workloads: list[Workload], cfg: Config) -> tuple[list[Row], tuple[int, int]]:
    """Every system on every workload, HF first; returns the rows and the random workload's output matches."""
    pad_id = ours.tokenizer.eos_token_id
    rows, matches = [], (0, 0)
    for w in workloads:
        print(f"[{w.name}] {len(w.prompts)} requests, {w.new_tokens} new tokens each", flush=True)
        hf_row, hf_out = run_hf(hf, w, cfg.hf_batch, pad_id)
        our_row, our_out = run_ours(ours, w, "radixlm")
        rows += [hf_row, our_row]
        if w.name == "random":
            matches = count_matches(our_out, hf_out)
        else:
            rows.append(run_without_cache(ours, w))
        print("  " + ", ".join(f"{r.system} {r.wall_s:.1f}s" for r in rows if r.workload == w.name), flush=True)
    return rows, matches


def run_without_cache(ours: LocalEngine, w: Workload) -> Row:
    """Our engine with the radix cache off (same weights): every request prefills its whole prompt."""
    engine = LocalEngine(ours.args.model_path, model=ours.worker.model, tokenizer=ours.tokenizer,
                    max_total_tokens=ours.args.max_total_tokens, disable_radix_cache=True,
                    quantization=ours.args.quantization)
    row, _ = run_ours(engine, w, "radixlm no-cache")
    del engine
    gc.collect()  # free its KV pool before anything else allocates
    return row


if __name__ == "__main__":
    main()
