"""Loading holds the served weights and one tensor's working set, never a float32 model (issue 46):
a random Q4_K / Q6_K / Q8_0 file of 100M weights loaded in a fresh process, its resident
high-water mark against the bytes it serves."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import gguf
import numpy as np

from radixlm.kernels.cpu import reference

LAYERS, HIDDEN, FFN, VOCAB, HEADS = 6, 1024, 4096, 8192, 16


def _random_gguf(path: str) -> tuple[int, int]:
    """A Llama-shaped file of random blocks (Q4_K_M's mix: Q4_K layers, Q6_K attn_v and ffn_down,
    a Q8_0 table): returns (its tensor bytes, the largest tensor's)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("context_length", 4096), ("embedding_length", HIDDEN), ("block_count", LAYERS),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", HEADS // 4), ("rope.dimension_count", HIDDEN // HEADS),
                       ("vocab_size", VOCAB)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 500000.0)
    sizes = []

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        raw = reference.random_blocks(kind, rows, cols, rng)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        sizes.append(raw.nbytes)

    add("token_embd.weight", "Q8_0", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    kv = HIDDEN // 4
    for i in range(LAYERS):
        for name, kind, rows, cols in (("attn_q", "Q4_K", HIDDEN, HIDDEN), ("attn_k", "Q4_K", kv, HIDDEN),
                                       ("attn_v", "Q6_K", kv, HIDDEN), ("attn_output", "Q4_K", HIDDEN, HIDDEN),
                                       ("ffn_gate", "Q4_K", FFN, HIDDEN), ("ffn_up", "Q4_K", FFN, HIDDEN),
                                       ("ffn_down", "Q6_K", HIDDEN, FFN)):
            add(f"blk.{i}.{name}.weight", kind, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sum(sizes), max(sizes)


_MEASURE = textwrap.dedent("""
    import json, sys
    from radixlm.kernels import cpu
    from radixlm.runtime.local_engine import LocalEngine
    cpu.load()

    def kb(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from here
    base = kb("VmRSS:")
    engine = LocalEngine(sys.argv[1], skip_tokenizer_init=True, max_total_tokens=256)
    info = engine.worker.weights_info()
    print(json.dumps({"base": base * 1024, "peak": kb("VmHWM:") * 1024, "now": kb("VmRSS:") * 1024,
                      "served": info["weight_bytes"], "formats": info["weight_formats"]}))
""")


def test_the_loader_peaks_at_the_served_weights_plus_one_tensor(tmp_path):
    path = str(tmp_path / "random.gguf")
    file_bytes, largest = _random_gguf(path)
    done = subprocess.run([sys.executable, "-c", _MEASURE, path], capture_output=True, text=True, timeout=600,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Q6_K" in m["formats"]["layers"] and "Q4_K" in m["formats"]["layers"]
    assert file_bytes <= m["served"] <= 1.05 * file_bytes  # every format at its own size
    # what loading added at its peak: the served weights, one tensor's pages of the mapped file,
    # and the runtime's own small tables; a float32 model would be 4 bytes a weight (400 MB here)
    weights = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN // 4 + 3 * HIDDEN * FFN) + VOCAB * HIDDEN
    grew = m["peak"] - m["base"]
    assert grew <= m["served"] + 2 * largest + (48 << 20), (grew, m)
    assert grew < weights, (grew, weights)  # under a byte a weight, where float32 was four
