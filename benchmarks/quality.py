"""What each served precision and each KV cache type costs in quality, against HF transformers fp32.

A fixed text (made here from a seeded generator: plain English sentences, the same every run)
is scored teacher-forced: every position's next-token distribution, from radixlm's prompt
logprobs, against transformers' fp32 forward pass over the same weights (a GGUF file's
dequantized ones). Printed per row:

* top-1 agreement: radixlm's most likely next token is HF's;
* flips at margin: of the disagreements, how many HF itself ranks within 0.1 nats (near-ties,
  where any rounding may flip the order), and the largest HF margin among them;
* mean |delta logprob| of the text's own next token, and its largest;
* perplexity of the text.

1. Precisions (SmolLM2, 2,048 tokens, each with its default KV type): each quantized precision
   scored on the codes (runtime/worker/quant.py: what every batch reads).
2. KV cache types (--kv-cache-dtype fp32, fp16, bf16, int8) on long texts (2,048 and 8,000
   tokens: SmolLM2's context is 8,192): SmolLM2 with exact fp32 weights (--quantization none:
   the KV type's error alone) and on the file's Q4_1 codes (auto), and a tiny Llama 3 made here
   (random weights, seeded; Llama 3's GQA of 4 query heads a KV head, its rotary base and
   scaling; SmolLM2's vocabulary so the same text serves) with its fp32 weights.

    python benchmarks/quality.py            # both tables (about 30 minutes on 2 cores)
    python benchmarks/quality.py --only kv --lengths 2048   # the KV table at 2,048 tokens
    python benchmarks/quality.py --quick    # 384 tokens: fp32 and auto; KV fp32 and fp16 on auto (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

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


KV_TYPES = ["fp32", "fp16", "bf16", "int8"]  # what a CPU serves (fp8_e4m3 is for GPUs)
LENGTHS = [2048, 8000]  # the KV table's texts (SmolLM2's context: 8,192 tokens)
# the KV table's models: (name, engine options); the tiny Llama 3 is made in a temporary folder
KV_MODELS = [("SmolLM2, fp32 weights (--quantization none)", {"quantization": "none"}),
             ("SmolLM2, Q4_1 codes (auto)", {"quantization": "auto"}),
             ("tiny Llama 3 (random, fp32 weights)", {})]
EMBED_STD = 0.3  # the tiny Llama 3's table: its top token's probability ~0.5 (median), ~1 nat above the next
HF_CHUNK = 1024  # tokens HF scores at a time (its KV cached between): logits of 8,000 tokens at once take 1.6 GB


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
    kv_cache_dtype: str = ""
    kv_bytes_per_token: int = 0
    tokens: int = 0


class Reference(NamedTuple):
    """HF fp32's scores of a text: per position t (predicting token t + 1), the text's own token's
    logprob, the two best logprobs and the best token."""

    own: torch.Tensor
    top2: torch.Tensor  # [n, 2]
    best: torch.Tensor

    @property
    def perplexity(self) -> float:
        return math.exp(-self.own.mean().item())


@torch.inference_mode()
def hf_reference(model: Any, ids: list[int]) -> Reference:
    """HF's log-distributions over `ids`, teacher-forced, HF_CHUNK tokens at a time over its KV cache
    (only what the scores need is kept)."""
    from transformers import DynamicCache

    cache, own, top2, best = DynamicCache(), [], [], []
    for start in range(0, len(ids) - 1, HF_CHUNK):
        chunk = ids[start : start + HF_CHUNK]
        # (past_key_values: the name transformers 4 and 5 both take; 5 warns that it prefers `cache`)
        logits = model(torch.tensor([chunk]), past_key_values=cache, use_cache=True).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)[: len(ids) - 1 - start]  # the last token predicts nothing here
        targets = torch.tensor(ids[start + 1 : start + 1 + logprobs.shape[0]])
        own.append(logprobs.gather(1, targets[:, None]).squeeze(1))
        top = logprobs.topk(2, dim=-1)
        top2.append(top.values)
        best.append(top.indices[:, 0])
    return Reference(torch.cat(own), torch.cat(top2), torch.cat(best))


def score(engine: LocalEngine, ids: list[int], ref: Reference) -> dict[str, float]:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    meta = out["meta_info"]
    own = torch.tensor([lp for lp, *_ in meta["input_token_logprobs"][1:]])
    top = torch.tensor([entry[0][1] for entry in meta["input_top_logprobs"][1:]])
    flipped = top != ref.best
    margins = (ref.top2[:, 0] - ref.top2[:, 1])[flipped]
    delta = (own - ref.own).abs()
    return dict(agreement=1 - flipped.float().mean().item(), flips=int(flipped.sum()),
                near_tie_flips=int((margins < NEAR_TIE).sum()), max_flip_margin=float(margins.max()) if len(margins) else 0.0,
                mean_abs_dlogprob=delta.mean().item(), max_abs_dlogprob=delta.max().item(),
                perplexity=math.exp(-own.mean().item()))


def served_formats(engine: LocalEngine) -> str:
    return "; ".join(f"{k}: {v}" for k, v in engine.worker.quantization.formats.items())


def precision_rows(path: str, tokenizer: Any, ids: list[int], ref: Reference, quick: bool) -> list[Row]:
    """Each served precision at its default KV type, on each kernel its batches read."""
    rows: list[Row] = []
    for name, options in PRECISIONS:
        if quick and name not in QUICK:
            continue
        engine = LocalEngine(path, tokenizer=tokenizer, max_total_tokens=len(ids) + 64, **options)
        q = engine.worker.quantization
        kernel = "dense" if q.method == "none" else "codes"
        rows.append(Row(name, kernel, served_formats(engine), q.weight_bytes / 1e6, **score(engine, ids, ref),
                        **kv_fields(engine, len(ids))))
        print(f"scored {name} [{kernel}]", flush=True)
        del engine
    return rows


def kv_fields(engine: LocalEngine, tokens: int) -> dict[str, Any]:
    info = engine.worker.kv_info()
    return dict(kv_cache_dtype=info["kv_cache_dtype"], kv_bytes_per_token=info["kv_bytes_per_token"], tokens=tokens)


def tiny_llama3(path: str, vocab_size: int) -> None:
    """A small Llama 3 with random weights (seeded): 4 layers of 512, 8 query heads over 2 KV heads of
    64, Llama 3's rotary base and llama3 scaling, a context of 16,384; norms drawn in [0.5, 1.5], the
    layers' weights of std 0.05 and the (tied) table's of EMBED_STD, so that its distributions are
    peaked enough for top-1 to mean something."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(31)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD)
    model.save_pretrained(path)


def kv_rows(source_path: str, tokenizer: Any, text: list[int], lengths: list[int], kv_types: list[str],
            models: list[tuple[str, dict]], refs: dict[tuple[str, int], Reference]) -> list[Row]:
    """Each model of `models` with each KV type, on the first `length` tokens of the text. `refs`:
    HF's scores already made, by (model path, length)."""
    import transformers

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tiny:
        for model_name, options in models:
            path = source_path if "SmolLM2" in model_name else tiny
            if path == tiny:
                tiny_llama3(tiny, tokenizer.vocab_size)
            hf = None
            for length in lengths:
                ids = text[:length]
                if (path, length) not in refs:
                    if hf is None:
                        hf = (load_hf_model(path) if path == source_path else
                              transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
                    refs[path, length] = hf_reference(hf, ids)
                ref = refs[path, length]
                for kv in kv_types:
                    engine = LocalEngine(path, tokenizer=tokenizer, max_total_tokens=length + 64, kv_cache_dtype=kv,
                                         **options)
                    q = engine.worker.quantization
                    kernel = "dense" if q.method == "none" else "codes"
                    rows.append(Row(model_name, kernel, served_formats(engine), q.weight_bytes / 1e6,
                                    **score(engine, ids, ref), **kv_fields(engine, length)))
                    print(f"scored {model_name}, KV {kv}, {length} tokens (HF perplexity {ref.perplexity:.3f})",
                          flush=True)
                    del engine
            del hf
    return rows


def print_precisions(rows: list[Row], hf_ppl: float) -> None:
    print("\n| precision | kernel | weights MB | KV | top-1 agreement | flips (near-ties) | max flip margin | "
          "mean abs dlogprob | max abs dlogprob | perplexity |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.precision} | {r.kernel} | {r.weight_mb:.0f} | {r.kv_cache_dtype} | {r.agreement * 100:.2f}% | "
              f"{r.flips} ({r.near_tie_flips}) | {r.max_flip_margin:.3f} | {r.mean_abs_dlogprob:.4f} | "
              f"{r.max_abs_dlogprob:.3f} | {r.perplexity:.3f} |")
    print(f"\nHF fp32 perplexity {hf_ppl:.3f}. Served weights:")
    for name in dict.fromkeys(r.precision for r in rows):
        print(f"- {name}: {next(r.served for r in rows if r.precision == name)}")


def print_kv(rows: list[Row]) -> None:
    print("\n| model | tokens | KV | bytes/token | top-1 agreement | flips (near-ties) | max flip margin | "
          "mean abs dlogprob | max abs dlogprob | perplexity |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.precision} | {r.tokens} | {r.kv_cache_dtype} | {r.kv_bytes_per_token} | {r.agreement * 100:.2f}% | "
              f"{r.flips} ({r.near_tie_flips}) | {r.max_flip_margin:.3f} | {r.mean_abs_dlogprob:.4f} | "
              f"{r.max_abs_dlogprob:.3f} | {r.perplexity:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="384 tokens: fp32 and auto; KV fp32 and fp16 on auto")
    ap.add_argument("--tokens", type=int, default=0, help="length of the precisions' text (default 2048, quick 384)")
    ap.add_argument("--only", choices=["precisions", "kv"], default=None, help="one of the two tables")
    ap.add_argument("--lengths", default=None, help="the KV table's text lengths, comma-separated (default 2048,8000)")
    ap.add_argument("--kv", default=None, help="the KV types, comma-separated (default fp32,fp16,bf16,int8)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    source = resolve_model(None)
    tokenizer = load_tokenizer(source)
    tokens = args.tokens or (384 if args.quick else 2048)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else [tokens] if args.quick else LENGTHS
    kv_types = args.kv.split(",") if args.kv else KV_TYPES[:2] if args.quick else KV_TYPES
    text = make_text(max([tokens] + lengths), tokenizer)
    model, features = cpu_info()
    print(f"CPU: {model}, {os.cpu_count()} cores, features: {' '.join(features) or '-'}")
    print(f"model: {source.name}; text: {len(text)} tokens (seeded, made by this script), "
          f"scored teacher-forced against HF transformers fp32 on the same weights\n")
    saved: dict[str, Any] = {"tokens": tokens}
    refs: dict[tuple[str, int], Reference] = {}
    if args.only != "kv":
        ids = text[:tokens]
        ref = refs[source.path, tokens] = hf_reference(load_hf_model(source.path), ids)
        print(f"HF fp32 perplexity: {ref.perplexity:.3f}\n")
        rows = precision_rows(source.path, tokenizer, ids, ref, args.quick)
        print_precisions(rows, ref.perplexity)
        saved.update(hf_perplexity=ref.perplexity, rows=[asdict(r) for r in rows])
    if args.only != "precisions":
        models = KV_MODELS[1:2] if args.quick else KV_MODELS
        rows = kv_rows(source.path, tokenizer, text, lengths, kv_types, models, refs)
        print_kv(rows)
        saved["kv_rows"] = [asdict(r) for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)


if __name__ == "__main__":
    main()
