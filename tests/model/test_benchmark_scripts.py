"""The benchmark scripts' quick modes run and print their tables (the full runs are for people)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_micro_benchmarks_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "micro.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for title in ("## Radix cache", "## Scheduler overhead", "## This machine", "## SmolLM2-135M",
                  "## SGLang's native API"):
        assert title in out
    radix = re.search(r"^\| 1000 \| (\d+) \| ([\d,]+) \| ([\d,]+) \|", out, re.M)
    assert radix and int(radix.group(1)) > 64  # the tree grew past the trunks
    ratios = [float(x) for x in re.findall(r"\| ([\d.]+)x \|$", out, re.M)]
    # the fp32 floor reads SmolLM2's 540 MB of fp32 weights: over a millisecond at any CPU's bandwidth
    floors = [float(x) for x in re.findall(r"^\| (?:1|8) \| [\d.]+ \| ([\d.]+) \| [\d.]+x \|$", out, re.M)]
    assert len(floors) == 2 and min(floors) > 1.0, out
    # both rows measured; no bound on the ratio itself: the step and the floor's bandwidth are timed
    # at different moments, so another process on the other core moves one and not the other
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_step_cost_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "step_cost.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"^CPU: .+, \d+ cores", out, re.M) and "GFLOP/s" in out
    decode = re.findall(r"^\| (1|8) \| ([\d.]+) \| (\d+) \| (\d+) \| (\d+)% \|$", out, re.M)
    assert [d[0] for d in decode] == ["1", "8"] and all(0 < float(d[1]) for d in decode)
    mixed = re.findall(r"^\| 8 \| (\d+) \| ([\d.]+) \| ", out, re.M)
    assert [m[0] for m in mixed] == ["0", "64", "256"]
    assert float(mixed[2][1]) > float(mixed[0][1]), "a step with a prompt on it costs more than decode alone"
    assert "| --deterministic |" in out and re.search(r"^\| 4 \| 1 \| .+ \| [+-][\d.]+% \|$", out, re.M)


def test_attention_kernels_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention_kernels.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^CPU: .+, \d+ cores", done.stdout, re.M), done.stdout
    rows = re.findall(r"^\| (\d+) x (\d+), (\d+) \| (fp32|fp16) \| (.+) \|$", done.stdout, re.M)
    assert [r[:4] for r in rows] == [(*shape, kv) for shape in (("1", "256", "768"), ("4", "64", "1000"))
                                     for kv in ("fp32", "fp16")], done.stdout
    for *_, cells in rows:  # each path and torch's: a time and a rate (the script checked every path against torch's)
        assert all(re.fullmatch(r"[\d.]+ ms, \d+ GFLOP/s", c.strip()) for c in cells.split("|")), cells
    decode = re.findall(r"^\| 16, 1000 \+ 20 \| (fp32|fp16) \| (.+) \|$", done.stdout, re.M)  # exact, blocked: each path
    assert [kv for kv, _ in decode] == ["fp32", "fp16"], decode
    assert all(re.fullmatch(r"\d+ us, \d+ GFLOP/s", c.strip()) for _, cells in decode for c in cells.split("|")), decode
    families = re.findall(r"^\| (Gemma 2 2B|gpt-oss 20B|SmolLM2 \(plain\)) \| 1 x 2000 \| (.+) \|$", done.stdout, re.M)
    assert [f for f, _ in families] == ["Gemma 2 2B", "gpt-oss 20B", "SmolLM2 (plain)"], done.stdout  # capped, sinks, plain
    assert all(re.fullmatch(r"[\d.]+ ms, \d+ GFLOP/s", c.strip()) for _, cells in families for c in cells.split("|"))


def test_quant_kernels_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "quant_kernels.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^\| (fp32 F.linear|Q\w+ codes \w+) \| (.+) \|$", done.stdout, re.M))
    assert {"fp32 F.linear", "Q4_1 codes portable", "Q8_0 codes portable"} <= set(rows), done.stdout
    assert re.search(r"^copy bandwidth [\d.]+ GB/s", done.stdout, re.M), done.stdout
    for name, cells in rows.items():
        *times, share, error = (c.strip() for c in cells.split("|"))
        assert all(float(t) > 0 for t in times) and re.fullmatch(r"\d+%", share), (name, times, share)
        # each kernel against the same quantized weights in fp32: only its own rounding (16-bit inputs) differs
        assert float(error) < 1e-3, (name, error)


def test_quality_quick(tmp_path):
    out_json = tmp_path / "quality.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "quality.py"), "--quick", "--json",
                           str(out_json)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^CPU: .+, \d+ cores", done.stdout, re.M) and "| precision | kernel |" in done.stdout
    saved = json.loads(out_json.read_text())
    assert saved["tokens"] >= 384 and 1 < saved["hf_perplexity"] < 100
    rows = {(r["precision"], r["kernel"]): r for r in saved["rows"]}
    fp32 = rows[("fp32 (--quantization none)", "dense")]
    assert fp32["agreement"] == 1.0 and fp32["mean_abs_dlogprob"] < 1e-3  # the same weights and arithmetic as HF
    served = [r for (name, _), r in rows.items() if name.startswith("auto")]
    assert {r["kernel"] for r in served} == {"codes"}
    assert all(r["agreement"] > 0.97 and "Q4_1 codes" in r["served"] for r in served), served
    # the KV table (quick: the codes with an fp32 and an fp16 KV): half the bytes, hardly a difference
    kv = {r["kv_cache_dtype"]: r for r in saved["kv_rows"]}
    assert set(kv) == {"fp32", "fp16"} and all(r["tokens"] == saved["tokens"] for r in kv.values())
    assert kv["fp32"]["kv_bytes_per_token"] == 2 * kv["fp16"]["kv_bytes_per_token"] == 46080
    assert kv["fp16"]["agreement"] > 0.99 and kv["fp16"]["mean_abs_dlogprob"] < 0.005, kv["fp16"]


def test_one_stream_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "one_stream.py"), "--quick"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r[0]: r for r in (line.strip("| ").split(" | ") for line in done.stdout.splitlines())
            if r[0] in ("none", "auto")}
    # auto is decided by facts (the CPU's flags, the file's formats): the embedded Q4_1 file's layers
    # are served from their 4-bit codes wherever the native kernels build
    assert rows["none"][1] == "none" and rows["auto"][1] == "int4", rows
    assert rows["none"][4] == "(the same)", rows  # fp32 has no native decoder: served = op by op
    for r in rows.values():
        # every time is positive; the split is timed apart from the step (no sum is asserted: load on
        # the other core moves one timing and not the other)
        times = [float(r[i]) for i in (2, 5, 6, 7, 9, 11)] + ([float(r[4])] if r[4] != "(the same)" else [])
        assert all(t > 0 for t in times), r
        assert float(r[8]) > 50, r  # MB read per token: the weights at least
    assert float(rows["auto"][8]) < 0.3 * float(rows["none"][8])  # the codes: a fifth of fp32's bytes
    # the served pass (the native decoder's call and the LM head) against the same run's copy bandwidth
    served = re.search(r"^auto: the batch-1 weight pass as served .+ ([\d.]+) ms for ([\d.]+) MB: ([\d.]+) GB/s, (\d+)% of",
                       done.stdout, re.M)
    assert served and float(served[2]) == float(rows["auto"][8]), done.stdout
    assert abs(float(served[2]) / float(served[1]) - float(served[3])) < 0.1, served.group(0)  # MB / ms = GB/s


def test_run_all_quick(tmp_path):
    """A workload of each kind on the systems that make the ratios: few-shot selection (mmlu; hellaswag
    is the same program on other data), constrained JSON, forks joined by a judge's selection
    (tree-of-thought; chat and react are its generation loop without the forks; no-sharing its
    fixed-length generation without the prefixes). (llama.cpp needs a
    binary built by hand; `radixlm fcfs` and `radixlm no-cache` differ only in an option, and the
    scheduler's property tests run every policy, cache on and off, and the JSON workload's
    jump-forward off is benchmarks/json_decode.py's; the options' plumbing is one code path.)"""
    systems = ["radixlm", "hf-static"]
    workloads = ["mmlu", "json", "tree-of-thought"]
    # the offline section alone: the online one (two more servers) is test_run_all_online_quick's
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--quick",
                           "--only", ",".join(workloads), "--systems", ",".join(systems), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "summary.json").read_text())["results"]
    by = {(r["workload"], r["system"]): r for r in results}
    for w in workloads:
        ran = {s for s in systems if (w, s) in by}
        assert ran == set(systems), (w, ran)
        assert all(by[(w, s)]["latencies_s"] for s in ran), w
    for w in ("mmlu", "tree-of-thought"):  # shared prefixes come from the radix cache
        assert by[(w, "radixlm")]["cached_tokens"] > 0.5 * by[(w, "radixlm")]["prompt_tokens"], w
    for w in ("tree-of-thought",):  # fixed lengths: the same work everywhere
        assert len({by[(w, s)]["output_tokens"] for s in systems if (w, s) in by}) == 1, w
        assert by[(w, "radixlm")]["output_tokens"] > 0, w
    for w in ("mmlu",):  # HF scores every choice and mostly picks what select picked
        assert by[(w, "hf-static")]["same_pick"] >= 0.6, by[(w, "hf-static")]
    summary = (tmp_path / "summary.md").read_text()
    assert "| mmlu | radixlm |" in summary and "Targets:" in summary
    for png in ("throughput.png", "latency_cdf.png", "cache_hit.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG", png
        (tmp_path / png).unlink()
    redraw = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--replot",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert redraw.returncode == 0, redraw.stderr[-2000:]
    assert all((tmp_path / png).exists() for png in ("throughput.png", "latency_cdf.png", "cache_hit.png"))


def test_grammar_backends_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "grammar_backends.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| (\w+) \| (json|tools) \|((?: [\d.]+ \|){8})$", done.stdout, re.M)
    assert [(b, w) for b, w, _ in rows] == [(b, w) for b in ("outlines", "llguidance", "xgrammar")
                                            for w in ("json", "tools")], done.stdout
    assert all(float(v) > 0 for _, _, cols in rows for v in cols.strip(" |").split(" | ")[:3])  # compiles take time


def test_speculative_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "speculative.py"), "--quick",
                           "--methods", "ngram", "--workloads", "code editing,random 32 streams"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"^CPU: .+, \d+ cores", out, re.M) and "GB/s" in out
    rows = re.findall(r"^\| (code editing|random 32 streams) \| (off|ngram) \| (\d+) \| ([\d.]+) \| ([\d.]+)x \| "
                      r"(\d+) \| .+ \| (\d+)/(\d+) \|$", out, re.M)
    assert [(r[0], r[1]) for r in rows] == [("code editing", "off"), ("code editing", "ngram"),
                                            ("random 32 streams", "off"), ("random 32 streams", "ngram")]
    assert int(rows[1][5]) > 0, "drafts were checked on the code edit"
    assert all(int(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_kv_tier_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kv_tier.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^\| (without the tier|with the tier) \| (.+) \|$", done.stdout, re.M))
    assert set(rows) == {"without the tier", "with the tier"}, done.stdout
    cached = {name: int(cells.split(" | ")[3]) for name, cells in rows.items()}
    assert cached["with the tier"] > cached["without the tier"], cached  # the restart and evictions cost it nothing
    assert re.search(r"^tier: [1-9]\d* turns read [1-9]\d* tokens back", done.stdout, re.M), done.stdout


def _make_models():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_models", os.path.join(ROOT, "benchmarks", "make_models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_models"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_make_models_k_blocks_decode_with_gguf():
    """make_models' own Q4_K and Q6_K encoders (gguf has none) against gguf's decoder: each block's
    values come back within their step (a wrong layout of codes, scales or mins would not)."""
    import gguf

    make_models = _make_models()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 1024)) * 0.02).astype(np.float32)
    x[0, :256] = np.abs(x[0, :256])  # a block with no negative value: its min is 0
    x[1, :256] = 0  # a zero block: scales 0, codes 0
    x[2, :256] *= 50  # a block far from the rest
    for qtype, sub, rms in ((gguf.GGMLQuantizationType.Q4_K, 32, 0.1), (gguf.GGMLQuantizationType.Q6_K, 16, 0.03)):
        blocks = make_models.quantize(x, qtype)
        assert blocks.shape == (8, 1024 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(blocks, qtype).reshape(x.shape)
        groups, err = x.reshape(-1, sub), np.abs(back - x).reshape(-1, sub)
        span = groups.max(1) - np.minimum(groups.min(1), 0)  # a sub-block's range: 15 (Q4_K) or 63 (Q6_K) steps
        assert (err.max(1) <= span / (15 if sub == 32 else 31) + 1e-6).all(), qtype
        assert np.sqrt(((back - x)[3:] ** 2).mean()) < rms * 0.02, qtype  # past the odd rows: N(0, 0.02)
        assert (back[1, :256] == 0).all(), qtype


def test_make_models_q4_k_m_layers():
    """The layers whose attn_v and ffn_down Q4_K_M gives Q6_K, as llama.cpp's use_more_bits picks them
    (the first and last eighth, and every third from the eighth's end + 2), listed by hand."""
    make_models = _make_models()
    for layers, picked in ((16, {0, 1, 4, 7, 10, 13, 14, 15}),
                           (32, {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31})):
        assert {i for i in range(layers) if make_models.use_more_bits(i, layers)} == picked, layers


def test_make_models_tiny(tmp_path):
    """make_models' generator on the tiny shapes: llama.cpp's tensor types for each file type, the
    weights' scale, and a forward pass through HF transformers' GGUF reader with finite, sane logits.
    (Written without the tokenizer's keys: each GGUF read parses its 49,152 tokens and merges in
    Python, seconds a read; test_make_models_cli copies them.)"""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    make_models = _make_models()
    paths = {m: str(tmp_path / make_models.file_name(m)) for m in ("tiny-q4_0", "tiny-q4_k_m", "tiny-moe-q4_k_m")}
    for model, path in paths.items():
        make_models.write_model(model, path, 0, tokenizer=[])
    readers = {m: gguf.GGUFReader(path) for m, path in paths.items()}
    types = {m: {t.name: t.tensor_type.name for t in r.tensors} for m, r in readers.items()}
    # llama.cpp's rules (src/llama-quant.cpp): the output table Q6_K, and a tied token_embd with it;
    # under Q4_K_M, attn_v and ffn_down Q6_K in the layers use_more_bits picks (of 2: the last)
    q4_0, k_m, moe = types["tiny-q4_0"], types["tiny-q4_k_m"], types["tiny-moe-q4_k_m"]
    assert (q4_0["token_embd.weight"], q4_0["blk.1.attn_v.weight"], q4_0["blk.1.ffn_down.weight"],
            q4_0["rope_freqs.weight"], q4_0["blk.0.attn_norm.weight"]) == ("Q6_K", "Q4_0", "Q4_0", "F32", "F32")
    assert (k_m["token_embd.weight"], k_m["blk.0.attn_q.weight"], k_m["blk.0.attn_v.weight"], k_m["blk.1.attn_v.weight"],
            k_m["blk.0.ffn_down.weight"], k_m["blk.1.ffn_down.weight"]) == ("Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q6_K")
    assert (moe["token_embd.weight"], moe["output.weight"], moe["blk.1.ffn_down_exps.weight"],
            moe["blk.0.ffn_gate_inp.weight"]) == ("Q4_K", "Q6_K", "Q6_K", "F32")
    assert readers["tiny-q4_k_m"].fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    for t in readers["tiny-q4_k_m"].tensors:
        if t.name.endswith("norm.weight"):
            assert (t.data == 1).all(), t.name
        elif t.name != "rope_freqs.weight":
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            assert abs(values.std() - 0.02) < 0.002 and abs(values.mean()) < 0.001, t.name

    ids = torch.tensor([[1, 100, 2000, 30000, 5, 6, 7, 8]])
    for model in ("tiny-q4_k_m", "tiny-moe-q4_k_m"):  # Q4_0 is gguf's own quantizer
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(paths[model]),
                                                  dtype=torch.float32)
        with torch.no_grad():
            logits = hf(ids).logits
        # the final norm's output has unit scale, the head N(0, 0.02) rows of 256: logits' std ~0.32
        assert torch.isfinite(logits).all() and 0.2 < logits.std().item() < 0.5, (model, logits.std())


def test_make_models_cli(tmp_path):
    """The command writes a file with SmolLM2's tokenizer keys, and a rerun skips it (same spec)."""
    import gguf

    from radixlm.runtime.model_config import default_model_path

    command = [sys.executable, os.path.join(ROOT, "benchmarks", "make_models.py"), "--models", "tiny-q4_0",
               "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("*.gguf")
    ours, smol = (gguf.GGUFReader(str(p)).fields for p in (path, default_model_path()))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert ours[key].contents() == smol[key].contents(), key
    assert ours["tokenizer.ggml.tokens"].contents() == smol["tokenizer.ggml.tokens"].contents()
    mtime = path.stat().st_mtime_ns
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "exists with the same spec" in again.stdout, again.stdout
    assert path.stat().st_mtime_ns == mtime
    make_models = _make_models()  # another seed is another spec: that file would be written again
    assert make_models.existing_spec(str(path)) == make_models.spec("tiny-q4_0", 0) != make_models.spec("tiny-q4_0", 1)
