"""Few-shot multiple choice (MMLU-like): a 5-shot prefix every question shares, then `select`.

    python benchmarks/few_shot.py          # --quick: 8 questions (CI)

The questions are generated (two-number arithmetic, four options; fixed seed).
Systems, in one run on the same weights:
- radixlm: the question as a `frontend_lang` program (`select` over " A".." D"),
  `run_batch` on the `Runtime` backend; the traced few-shot prefix is prefilled
  once and every choice of every question reuses it from the radix cache;
- radixlm with `--disable-radix-cache`: the same program, every prefix recomputed;
- HF static: `transformers` forward passes in left-padded batches of 8, one per
  choice (prompt + choice), scored like `select` (the choice token's logprob).
Reported: wall time, questions/s, the ratio to HF static, accuracy, and how often
radixlm and HF picked the same option.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import frontend_lang as fl  # noqa: E402
from runtime.worker.loader import default_model_path  # noqa: E402

LETTERS = ["A", "B", "C", "D"]


def question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    right = a + b
    options = {right}
    while len(options) < 4:
        options.add(right + rng.choice([-20, -10, -2, -1, 1, 2, 10, 20]))
    options = sorted(options, key=lambda _: rng.random())
    text = f"Question: What is {a} + {b}?\n" + "".join(f"{letter}. {o}\n" for letter, o in zip(LETTERS, options))
    return text + "Answer:", options.index(right)


def dataset(n: int, seed: int = 0) -> tuple[str, list[tuple[str, int]]]:
    rng = random.Random(seed)
    shots = "The following are multiple choice questions about arithmetic.\n\n"
    for _ in range(5):
        text, answer = question(rng)
        shots += f"{text} {LETTERS[answer]}\n\n"
    return shots, [question(rng) for _ in range(n)]


@fl.function
def multiple_choice(s, shots, text):
    s += shots + text
    s += fl.select("answer", [f" {letter}" for letter in LETTERS])


def run_radixlm(backend: fl.Backend, shots: str, items: list[tuple[str, int]]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    states = multiple_choice.run_batch([{"shots": shots, "text": text} for text, _ in items], backend=backend)
    wall = time.perf_counter() - start
    return wall, [LETTERS.index(st["answer"].strip()) for st in states]


def run_hf(model, tokenizer, shots: str, items: list[tuple[str, int]], batch: int = 8) -> tuple[float, list[int]]:
    """Static batches: one padded forward pass per choice; the choice's token logprob decides."""
    choice_ids = [tokenizer.encode(f" {letter}", add_special_tokens=False)[-1] for letter in LETTERS]
    picks: list[int] = []
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        prompts = [tokenizer.encode(shots + text, add_special_tokens=False) for text, _ in items[i:i + batch]]
        scores = torch.empty(len(prompts), len(LETTERS))
        for c, token in enumerate(choice_ids):
            rows = [p + [token] for p in prompts]
            width = max(map(len, rows))
            ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, -2].float()
            scores[:, c] = torch.log_softmax(logits, -1)[:, token]
        picks.extend(scores.argmax(1).tolist())
    return time.perf_counter() - start, picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 questions")
    args = ap.parse_args()
    n = 8 if args.quick else args.questions
    torch.set_num_threads(os.cpu_count() or 1)
    shots, items = dataset(n)
    answers = [a for _, a in items]
    rows = []
    picks = {}
    for name, options in (("radixlm", {}), ("radixlm, cache off", {"disable_radix_cache": True})):
        backend = fl.Runtime(max_total_tokens=32768, **options)
        try:
            run_radixlm(backend, shots, items[:2])  # warm up (the cache is flushed after)
            backend.flush_cache()
            wall, picks[name] = run_radixlm(backend, shots, items)
        finally:
            backend.shutdown()
        rows.append((name, wall))
    import transformers

    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32).eval()
    run_hf(model, tokenizer, shots, items[:2])  # warm up
    wall, picks["hf static (batch 8)"] = run_hf(model, tokenizer, shots, items)
    rows.append(("hf static (batch 8)", wall))
    hf_wall = rows[-1][1]
    print(f"{n} questions, 5-shot prefix {len(tokenizer.encode(shots))} tokens, SmolLM2-135M fp32, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print(f"{'system':<20} | {'wall s':>7} | {'q/s':>6} | {'vs HF':>6} | accuracy | same pick as HF")
    for name, wall in rows:
        acc = sum(p == a for p, a in zip(picks[name], answers)) / n
        same = sum(p == h for p, h in zip(picks[name], picks["hf static (batch 8)"])) / n
        print(f"{name:<20} | {wall:7.2f} | {n / wall:6.2f} | {hf_wall / wall:5.2f}x | {acc:8.0%} | {same:.0%}")


if __name__ == "__main__":
    main()
