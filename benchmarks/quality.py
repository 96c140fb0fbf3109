"""What each served precision costs in quality, against HF transformers fp32 on the same GGUF.

A fixed text (made here from a seeded generator: plain English sentences, the same every run)
is scored teacher-forced: every position's next-token distribution, from radixlm's prompt
logprobs, against transformers' fp32 forward pass over the file's dequantized weights. Printed
per precision:

* top-1 agreement: radixlm's most likely next token is HF's;
* flips at margin: of the disagreements, how many HF itself ranks within 0.1 nats (near-ties,
  where any rounding may flip the order), and the largest HF margin among them;
* mean |delta logprob| of the text's own next token, and its largest;
* perplexity of the text.

Each quantized precision is scored on the codes (runtime/worker/quant.py: what every batch reads).

    python benchmarks/quality.py            # 2,048+ tokens, every precision (a few minutes)
    python benchmarks/quality.py --quick    # 384 tokens, fp32 and auto (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import cpu_info  # noqa: E402
from radixlm.runtime.hf_reference import load_hf_model  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402
from radixlm.runtime.tokenizer.loader import load_tokenizer  # noqa: E402
from radixlm.runtime.model_config import resolve_model  # noqa: E402

NEAR_TIE = 0.1  # nats between HF's top two: a flip there says nothing about the precision

# (name, engine options); "auto" on the embedded file: its Q4_1 codes as int4, Q8_0 table as int8
PRECISIONS = [
    ("fp32 (--quantization none)", {"quantization": "none"}),
    ("auto: file's Q4_1 codes as int4 g32", {"quantization": "auto"}),
    ("int8 g32 (--quantization int8)", {"quantization": "int8"}),
    ("int4 g64, requantized (--quantization int4 --quantization-group-size 64)",
     {"quantization": "int4", "quantization_group_size": 64}),
]
QUICK = ("fp32 (--quantization none)", "auto: file's Q4_1 codes as int4 g32")

_SUBJECTS = ["The old library", "A small village", "The river", "Every morning the baker", "The committee",
             "My grandmother", "The new train line", "A young engineer", "The museum", "The farmers"]
_VERBS = ["opened", "described", "carried", "measured", "remembered", "planted", "repaired", "visited",
          "counted", "painted"]
_OBJECTS = ["a map of the northern hills", "twelve baskets of apples", "the letters from the war",
            "a bridge across the valley", "the results of the long survey", "a garden behind the school",
            "the clock in the town square", "three boats for the summer", "a history of the harbour",
            "the roads to the coast"]
_TAILS = ["before the winter came.", "while the children watched.", "because nobody else would.",
          "and then went home for dinner.", "in less than a week.", "with help from the neighbours.",
          "as the rain began to fall.", "for the first time in years.", "without saying a word.",
          "after the meeting ended."]
_LINKS = ["Later that year,", "At the same time,", "For this reason,", "In the evening,", "Some people said that",
          "Nobody knows why", "According to the records,", "Soon afterwards,"]


def make_text(min_tokens: int, tokenizer: Any, seed: int = 17) -> list[int]:
    """Paragraphs of simple sentences, seeded, until they reach `min_tokens` tokens."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while True:
        parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS)]
        if rng.random() < 0.4:
            parts.insert(0, rng.choice(_LINKS))
            parts[1] = parts[1][0].lower() + parts[1][1:]
        sentences.append(" ".join(parts))
        if len(sentences) % 5 == 0:
            sentences[-1] += "\n\n"
        ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False)
        if len(ids) >= min_tokens:
            return ids


@dataclass
class Row:
    precision: str
    kernel: str
    served: str  # the engine's own description of its weights
    weight_mb: float
    agreement: float
    flips: int
    near_tie_flips: int
    max_flip_margin: float
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    perplexity: float


def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: HF fp32's log-distribution of token t + 1 given tokens 0..t."""
    model = load_hf_model(path)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def score(engine: LocalEngine, ids: list[int], ref: torch.Tensor) -> dict[str, float]:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    meta = out["meta_info"]
    own = torch.tensor([lp for lp, *_ in meta["input_token_logprobs"][1:]])
    top = torch.tensor([entry[0][1] for entry in meta["input_top_logprobs"][1:]])
    targets = torch.tensor(ids[1:])
    ref_own = ref.gather(1, targets[:, None]).squeeze(1)
    ref_top2 = ref.topk(2, dim=-1)
    flipped = top != ref_top2.indices[:, 0]
    margins = (ref_top2.values[:, 0] - ref_top2.values[:, 1])[flipped]
    delta = (own - ref_own).abs()
    return dict(agreement=1 - flipped.float().mean().item(), flips=int(flipped.sum()),
                near_tie_flips=int((margins < NEAR_TIE).sum()), max_flip_margin=float(margins.max()) if len(margins) else 0.0,
                mean_abs_dlogprob=delta.mean().item(), max_abs_dlogprob=delta.max().item(),
                perplexity=math.exp(-own.mean().item()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="384 tokens, fp32 and auto only")
    ap.add_argument("--tokens", type=int, default=0, help="length of the text (default 2048, quick 384)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    source = resolve_model(None)
    tokenizer = load_tokenizer(source)
    ids = make_text(args.tokens or (384 if args.quick else 2048), tokenizer)
    model, features = cpu_info()
    print(f"CPU: {model}, {os.cpu_count()} cores, features: {' '.join(features) or '-'}")
    print(f"model: {source.name}; text: {len(ids)} tokens (seeded, made by this script), "
          f"scored teacher-forced against HF transformers fp32 on the same file\n")
    ref = hf_logprobs(source.path, ids)
    ref_ppl = math.exp(-ref.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())
    print(f"HF fp32 perplexity: {ref_ppl:.3f}\n")
    rows: list[Row] = []
    for name, options in PRECISIONS:
        if args.quick and name not in QUICK:
            continue
        engine = LocalEngine(source.path, tokenizer=tokenizer, max_total_tokens=len(ids) + 64, **options)
        q = engine.worker.quantization
        served = "; ".join(f"{k}: {v}" for k, v in q.formats.items())
        kernel = "dense" if q.method == "none" else "codes"
        rows.append(Row(name, kernel, served, q.weight_bytes / 1e6, **score(engine, ids, ref)))
        print(f"scored {name} [{kernel}]", flush=True)
        del engine
    print("\n| precision | kernel | weights MB | top-1 agreement | flips (near-ties) | max flip margin | "
          "mean abs dlogprob | max abs dlogprob | perplexity |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.precision} | {r.kernel} | {r.weight_mb:.0f} | {r.agreement * 100:.2f}% | {r.flips} ({r.near_tie_flips}) "
              f"| {r.max_flip_margin:.3f} | {r.mean_abs_dlogprob:.4f} | {r.max_abs_dlogprob:.3f} | {r.perplexity:.3f} |")
    print(f"\nHF fp32 perplexity {ref_ppl:.3f}. Served weights:")
    for name in dict.fromkeys(r.precision for r in rows):
        print(f"- {name}: {next(r.served for r in rows if r.precision == name)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": len(ids), "hf_perplexity": ref_ppl, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
