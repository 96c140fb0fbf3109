"""What a long conversation holds on a sliding-window model: the KV pool's resident memory per
layer kind, with window pages (the default) and without (--disable-window-pages).

A random Gemma 3 text model made here with transformers' own classes (hidden 512, 12 layers: 10
sliding over a window of 512 beside 2 global, 4 KV heads of 64): a conversation of TURNS turns,
each adding 1,000 new tokens to the history and answering with 16, every turn's prompt the whole
history (the radix cache holds it, so a turn prefills only its new tokens). After the last turn
the pool's resident bytes are read per layer from /proc/self/smaps (each layer's K and V are an
anonymous mapping of their own, zeroed lazily: resident only where written), beside the tokens
the cache holds and those whose sliding layers' K/V are still held. The wall time of the whole
conversation is printed for both, to show what giving pages back costs.

    python benchmarks/sliding_window.py            # about a minute
    python benchmarks/sliding_window.py --turns 3  # shorter
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import tempfile
import time

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402

WINDOW, NEW_TOKENS, ANSWER = 512, 1000, 16
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW,
             max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_model(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Gemma3TextConfig(**SHAPE)).save_pretrained(path)


def resident_bytes(tensors: list[torch.Tensor]) -> list[int]:
    """Resident bytes of each tensor's memory, page by page (mincore(2): the kernel's own count of
    which pages of the range are in memory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    out = []
    for t in tensors:
        start = t.data_ptr() // page * page
        length = t.data_ptr() + t.numel() * t.element_size() - start
        pages = -(-length // page)
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(start, length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        out.append(sum(b & 1 for b in vec.raw) * page)
    return out


def converse(path: str, turns: int, model, **kwargs) -> tuple[dict, object]:
    rng = random.Random(0)
    engine = LocalEngine(path, skip_tokenizer_init=True, quantization="none", model=model,
                         max_total_tokens=turns * (NEW_TOKENS + ANSWER) + 4096, **kwargs)
    try:
        history: list[int] = []
        started = time.perf_counter()
        cached = 0
        for _ in range(turns):
            history += [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(NEW_TOKENS)]
            out = engine.generate(input_ids=history, sampling_params={"max_new_tokens": ANSWER, "temperature": 0,
                                                                     "ignore_eos": True})
            cached += out["meta_info"]["cached_tokens"]
            history += out["output_ids"]
        seconds = time.perf_counter() - started
        cfg, pool, kv = engine.worker.config, engine.worker.kv_pool, engine.scheduler.kv
        rss = [a + b for a, b in zip(resident_bytes(pool.k_heads), resident_bytes(pool.v_heads))]
        sliding = [cfg.window(i) is not None for i in range(cfg.num_layers)]
        result = {
            "seconds": seconds, "history": len(history), "cached_hits": cached,
            "tree_tokens": (kv.cache.evictable_pages + kv.cache.locked_pages) * kv.page_size,
            "window_tokens": kv.window_bound_tokens,
            "global_mb": sum(r for r, s in zip(rss, sliding) if not s) / 1e6,
            "sliding_mb": sum(r for r, s in zip(rss, sliding) if s) / 1e6,
            "layers": (sliding.count(False), sliding.count(True)),
        }
        return result, engine.worker.model
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    print("\n".join(measure().lines()))
    with tempfile.TemporaryDirectory() as root:
        make_model(root)
        rows = []
        # the weights loaded once, and warmed by a turn before either run is timed
        model = converse(root, 1, None)[1]
        for name, kwargs in (("--disable-window-pages", {"disable_window_pages": True}), ("window pages (default)", {})):
            result, model = converse(root, args.turns, model, **kwargs)
            rows.append((name, result))
    g, s = rows[0][1]["layers"]  # noqa: E741
    print(f"\nGemma 3 text, random weights: {g} global + {s} sliding layers (window {WINDOW}), 4 KV heads of 64, fp32; "
          f"{args.turns} turns of {NEW_TOKENS} new tokens + {ANSWER} answered\n")
    print("| mode | history tokens | tokens in the tree | sliding K/V held for | resident KV, global layers | "
          "resident KV, sliding layers | conversation wall time |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        held = "every token" if r["window_tokens"] is None else f"{r['window_tokens']} tokens"
        print(f"| {name} | {r['history']} | {r['tree_tokens']} | {held} | {r['global_mb']:.1f} MB | "
              f"{r['sliding_mb']:.1f} MB | {r['seconds']:.1f} s |")


if __name__ == "__main__":
    main()
