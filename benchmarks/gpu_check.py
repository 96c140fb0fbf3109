"""GPU check of the Triton attention kernels and the runtime on them (run by scripts/gpu_check.sh).

    python benchmarks/gpu_check.py                 # on a CUDA machine: writes benchmarks/results/gpu.md
    python benchmarks/gpu_check.py --dry-run       # anywhere: the same code paths, tiny shapes, interpreter

1. correctness at real sizes: extend and decode against their torch references (bf16, paged, GQA);
2. decode attention time (batch x context, Llama-3-8B heads) as achieved bytes/s against a
   device-to-device copy measured in the same run;
3. extend attention time as FLOP/s against torch's own SDPA (flash) on the same causal shapes,
   and the best of other block shapes, warps and stages (EXTEND_CONFIGS) beside the default;
4. end to end: a random-weight Llama-3-8B-shaped model in bf16 (`load_format=dummy`), output tokens/s;
5. a profile (torch.profiler) of 20 decode steps at batch 1 and at 128 and of one prefill-heavy
   step, on the engine's defaults: host ms a step, the GPU's busy ms a step and its idle share of
   the window, host-device syncs and `.item()` reads a step, and the top kernels by GPU time (in
   the dry run the top-level torch ops on the CPU stand in for kernels);
6. decode tokens/s at batch 1, 32 and 128 with CUDA graphs on and off and overlap scheduling on and
   off (one copy of the weights; in the dry run "graphs on" runs the graph runner's static padded
   batches eagerly, as nothing captures on a CPU);
7. the same decode workload through `radixlm bench serve` against `radixlm serve` (graphs and
   overlap at their defaults).
Only widely available APIs: `triton.testing.do_bench`, `torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from radixlm.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from radixlm.kernels.extend_attention import (ExtendConfig, extend_attention, extend_attention_reference,  # noqa: E402
                                              extend_config)

DEVICE = "cpu" if DRY else "cuda"
DTYPE = torch.float32 if DRY else torch.bfloat16
# Llama-3-8B attention layout; tiny in the dry run
HEADS, KV_HEADS, DIM = (4, 2, 64) if DRY else (32, 8, 128)
PAGE = 16
# extend attention's alternatives to extend_config's choice, each timed beside it (query block x key
# block, warps, pipeline stages)
EXTEND_CONFIGS = ([ExtendConfig(32, 16, 4, 1)] if DRY else
                  [ExtendConfig(64, 64, 4, 1), ExtendConfig(64, 64, 4, 3), ExtendConfig(128, 64, 8, 2),
                   ExtendConfig(128, 64, 8, 3), ExtendConfig(128, 32, 4, 2), ExtendConfig(128, 128, 8, 2)])


def bench_ms(fn) -> float:
    if DRY:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def paged(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A token table over scattered pages: (table, rows, slots)."""
    pages = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(pages), device=DEVICE)
    table = torch.zeros(len(seq_lens), max(pages) * PAGE, dtype=torch.int64, device=DEVICE)
    used = 0
    for b, n in enumerate(pages):
        table[b, : n * PAGE] = (order[used:used + n, None] * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()
        used += n
    return table, torch.arange(len(seq_lens), device=DEVICE), sum(pages) * PAGE


def pool(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(slots, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE),
            torch.randn(slots, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check_correctness(rows: list[str]) -> None:
    prefix, extend = ([0, 17], [9, 5]) if DRY else ([0, 512, 1000], [1024, 1024, 77])
    table, req_rows, slots = paged([p + e for p, e in zip(prefix, extend)])
    k_cache, v_cache = pool(slots)
    t = sum(extend)
    q = torch.randn(t, HEADS, DIM, device=DEVICE, dtype=DTYPE)
    args = (q, k_cache, v_cache, table, req_rows, torch.tensor(prefix, device=DEVICE),
            torch.tensor(extend, device=DEVICE), DIM ** -0.5)  # (the new tokens' K/V: what the pool holds there)
    rows.append(f"| extend | prefix {prefix}, extend {extend} | {rel_err(extend_attention(*args), extend_attention_reference(*args)):.2e} |")
    seq = [1, 40] if DRY else [1, 777, 4096, 8191]
    table, req_rows, slots = paged(seq)
    k_cache, v_cache = pool(slots)
    q = torch.randn(len(seq), HEADS, DIM, device=DEVICE, dtype=DTYPE)
    args = (q, k_cache, v_cache, table, req_rows, torch.tensor(seq, device=DEVICE), DIM ** -0.5)
    rows.append(f"| decode | contexts {seq} | {rel_err(decode_attention(*args), decode_attention_reference(*args)):.2e} |")


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write) of a large buffer."""
    n = (1 << 16) if DRY else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * n / (bench_ms(lambda: dst.copy_(src)) * 1e-3)


def time_decode(rows: list[str], copy_bw: float) -> None:
    shapes = [(2, 64)] if DRY else [(64, 1024), (64, 8192), (256, 1024), (256, 4096)]
    for batch, ctx in shapes:
        table, req_rows, slots = paged([ctx] * batch)
        k_cache, v_cache = pool(slots)
        q = torch.randn(batch, HEADS, DIM, device=DEVICE, dtype=DTYPE)
        seq = torch.full((batch,), ctx, device=DEVICE)
        ms = bench_ms(lambda: decode_attention(q, k_cache, v_cache, table, req_rows, seq, DIM ** -0.5))
        moved = 2 * batch * ctx * KV_HEADS * DIM * k_cache.element_size()
        bw = moved / (ms * 1e-3)
        rows.append(f"| {batch} | {ctx} | {ms:.3f} | {bw / 1e9:.0f} | {bw / copy_bw:.0%} |")


def time_extend(rows: list[str]) -> None:
    shapes = [(32, 0), (32, 32)] if DRY else [(1024, 0), (4096, 0), (8192, 0), (4096, 4096)]
    for n, prefix in shapes:
        table, req_rows, slots = paged([prefix + n])
        k_cache, v_cache = pool(slots)
        q = torch.randn(n, HEADS, DIM, device=DEVICE, dtype=DTYPE)
        k, v = (c[table[0, prefix : prefix + n]] for c in (k_cache, v_cache))  # the new tokens' K/V (the SDPA baseline)
        pre, ext = torch.tensor([prefix], device=DEVICE), torch.tensor([n], device=DEVICE)
        ms = bench_ms(lambda: extend_attention(q, k_cache, v_cache, table, req_rows, pre, ext, DIM ** -0.5))
        flops = 4 * HEADS * DIM * (n * (n + 1) / 2 + n * prefix)
        ours = flops / (ms * 1e-3)
        tried = {}  # the other block shapes, warps and stages: what the next round should pick
        for c in EXTEND_CONFIGS:
            try:
                tried[c] = bench_ms(lambda: extend_attention(q, k_cache, v_cache, table, req_rows, pre, ext,
                                                             DIM ** -0.5, config=c))
            except Exception:  # (one that does not fit this GPU's shared memory is no contender)
                if DRY:
                    raise
        best = min(tried, key=tried.get) if tried else None
        alternative = "-" if best is None else (f"{best.block_m}x{best.block_n}, {best.num_warps} warps, "
                                                f"{best.num_stages} stages: {flops / (tried[best] * 1e-3) / 1e12:.1f}")
        baseline = "-"
        if prefix == 0:
            qs = q.transpose(0, 1)[None]
            ks, vs = (x.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None] for x in (k, v))
            sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
            baseline = f"{flops / (sdpa_ms * 1e-3) / 1e12:.1f} ({ours / (flops / (sdpa_ms * 1e-3)):.2f}x)"
        rows.append(f"| {n} | {prefix} | {ms:.3f} | {ours / 1e12:.1f} | {alternative} | {baseline} |")


SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512) if DRY else dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256)
DECODE_BATCHES = (3,) if DRY else (1, 32, 128)
DECODE_PROMPT, DECODE_NEW = (16, 4) if DRY else (128, 128)


def llama3_shape(path: str) -> str:
    import transformers

    transformers.LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=4096,
                             rope_theta=500000.0, **SHAPE).save_pretrained(path)
    return path


def engine_args(**extra) -> dict:
    return dict(load_format="dummy", skip_tokenizer_init=True, device=DEVICE, dtype="float32" if DRY else "bfloat16",
                attention_backend="triton", page_size=PAGE, **extra)


def end_to_end(rows: list[str], path: str) -> None:
    from radixlm.runtime.local_engine import LocalEngine

    requests, prompt, new = (2, 16, 4) if DRY else (128, 512, 128)
    engine = LocalEngine(path, max_total_tokens=requests * (prompt + new) + 4096, **engine_args())
    ids = torch.randint(0, SHAPE["vocab_size"], (requests, prompt)).tolist()
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=ids[:2], sampling_params={**params, "max_new_tokens": 2})  # warm up
    start = time.perf_counter()
    results = engine.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - start
    engine.shutdown()
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    rows.append(f"| {requests} x ({prompt} prompt + {new} new) | {wall:.1f} | {tokens / wall:.0f} | "
                f"{requests * (prompt + new) / wall:.0f} |")


PROFILE_STEPS = 2 if DRY else 20
WARM_STEPS = 0 if DRY else 20  # graphs captured and Triton compiled before the window (nothing to warm in the dry run)
PROFILE_BATCHES = (3,) if DRY else (1, 128)
PREFILL_REQUESTS, PREFILL_PROMPT = (2, 32) if DRY else (8, 1024)  # one prefill-heavy step's prompts
# host-device synchronizations the CUDA runtime records (a read of a device value, `.item()`, is
# counted apart: aten::_local_scalar_dense, on the CPU too)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
TOP_KERNELS = 5


def add_requests(sched, n: int, prompt: int, new: int, tag: str) -> None:
    from radixlm.runtime.messages import TokenizedRequest
    from radixlm.runtime.sampling_params import SamplingParams

    for i in range(n):
        ids = torch.randint(0, SHAPE["vocab_size"], (prompt,)).tolist()
        sched.add_request(TokenizedRequest(f"{tag}-{i}-{time.monotonic_ns()}", ids, SamplingParams(
            max_new_tokens=new, temperature=0, ignore_eos=True)))


def profiled_steps(sched, steps: int):
    """`steps` scheduler steps under torch.profiler, the device drained inside the window: (the
    profile, each step's host seconds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
    host = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            sched.step()
            host.append(time.perf_counter() - start)
        if not DRY:
            torch.cuda.synchronize()
    return prof, host


def kernel_events(prof) -> list:
    """The device's kernels (and copies); in the dry run the top-level torch ops stand in."""
    from torch.autograd import DeviceType

    events = prof.events()
    if not DRY:
        return [e for e in events if e.device_type == DeviceType.CUDA]
    return [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]


def busy_us(kernels: list) -> tuple[float, float]:
    """(microseconds with some kernel running, the window from the first start to the last end)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    if not spans:
        return 0.0, 0.0
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo = busy + hi - lo, a
        hi = max(hi, b)
    return busy + hi - lo, spans[-1][1] - spans[0][0]


def profile_rows(rows: list[str], tops: list[str], label: str, prof, host: list[float]) -> None:
    from collections import Counter

    steps = len(host)
    kernels = kernel_events(prof)
    busy, window = busy_us(kernels)
    names = Counter(e.name for e in prof.events())
    syncs = sum(names[c] for c in SYNC_CALLS)
    reads = names["aten::_local_scalar_dense"]
    idle = f"{1 - busy / window:.0%}" if window else "-"
    rows.append(f"| {label} | {1e3 * sum(host) / steps:.2f} | {busy / 1e3 / steps:.2f} | {idle} | "
                f"{syncs / steps:.1f} | {reads / steps:.1f} |")
    by_kernel = Counter()
    for e in kernels:
        by_kernel[e.name] += e.time_range.elapsed_us()
    for name, us in by_kernel.most_common(TOP_KERNELS):
        short = name if len(name) <= 60 else name[:57] + "..."
        tops.append(f"| {label} | `{short}` | {us / 1e3 / steps:.3f} | {us / busy:.0%} |")


def profile_steps(rows: list[str], path: str) -> None:
    """What a step costs, on the engine's defaults (graphs and overlap as they are on this device):
    decode at each of PROFILE_BATCHES, then one prefill-heavy step. Two tables: per step, and the
    top kernels of each."""
    from radixlm.runtime.local_engine import LocalEngine

    batch = max(PROFILE_BATCHES)
    tokens = max(batch * (DECODE_PROMPT + WARM_STEPS + PROFILE_STEPS + 2), PREFILL_REQUESTS * (PREFILL_PROMPT + 2)) + 4096
    engine = LocalEngine(path, max_total_tokens=tokens, cuda_graph_max_bs=batch, **engine_args())
    sched, tops = engine.scheduler, []
    try:
        for n in PROFILE_BATCHES:
            add_requests(sched, n, DECODE_PROMPT, WARM_STEPS + PROFILE_STEPS + 2, f"p{n}")
            while sched.waiting or sched.chunked:
                sched.step()
            for _ in range(WARM_STEPS):
                sched.step()
            prof, host = profiled_steps(sched, PROFILE_STEPS)
            profile_rows(rows, tops, f"decode, batch {n}", prof, host)
            while sched.has_work:
                sched.step()
        add_requests(sched, PREFILL_REQUESTS, PREFILL_PROMPT, 1, "prefill")
        prof, host = profiled_steps(sched, 1)
        profile_rows(rows, tops, f"prefill, {PREFILL_REQUESTS} x {PREFILL_PROMPT} tokens (first step)", prof, host)
        while sched.has_work:
            sched.step()
    finally:
        engine.shutdown()
    rows.extend(["", f"Top {TOP_KERNELS} kernels by {'CPU (dry run)' if DRY else 'GPU'} time:", "",
                 "| workload | kernel | ms a step | of busy |", "|---|---|---|---|", *tops])


def decode_rate(engine, batch: int) -> float:
    """Output tokens/s of `batch` requests decoding together, their prefill not timed."""
    sched = engine.scheduler
    add_requests(sched, batch, DECODE_PROMPT, DECODE_NEW, f"d{batch}")
    while sched.waiting or sched.chunked:
        sched.step()
    start = time.perf_counter()
    while sched.has_work:
        sched.step()
    if not DRY:
        torch.cuda.synchronize()
    return batch * (DECODE_NEW - 1) / (time.perf_counter() - start)


def decode_matrix(rows: list[str], path: str) -> None:
    """Decode tokens/s by batch, CUDA graphs on/off x overlap on/off, on one copy of the weights."""
    from radixlm.runtime.local_engine import LocalEngine
    from radixlm.runtime.worker.cuda_graph import DecodeGraphRunner

    tokens = max(DECODE_BATCHES) * (DECODE_PROMPT + DECODE_NEW) + 4096
    model, rates = None, {}
    for graphs in (True, False):
        for overlap in ("on", "off"):
            engine = LocalEngine(path, model=model, max_total_tokens=tokens, overlap_schedule=overlap,
                                 disable_cuda_graph=not graphs, cuda_graph_max_bs=max(DECODE_BATCHES), **engine_args())
            model = engine.worker.model
            if graphs and DRY:  # nothing captures on a CPU: the runner's static batches, eagerly
                engine.worker.graph_runner = DecodeGraphRunner(engine.worker, max(DECODE_BATCHES))
            if not DRY:
                decode_rate(engine, 2)  # warm up (Triton compiles)
            for batch in DECODE_BATCHES:
                rates[graphs, overlap, batch] = decode_rate(engine, batch)
            if graphs:
                assert engine.worker.graph_runner.replays > 0, "the graph runner ran no step"
            engine.shutdown()
    for batch in DECODE_BATCHES:
        base = rates[False, "off", batch]
        cells = " | ".join(f"{rates[g, o, batch]:.0f} ({rates[g, o, batch] / base:.2f}x)"
                           for g in (True, False) for o in ("on", "off"))
        rows.append(f"| {batch} | {cells} |")


def bench_serve(rows: list[str], path: str) -> None:
    """`radixlm bench serve` against `radixlm serve` on the same model, all requests at once."""
    import json
    import socket
    import subprocess

    from radixlm.runtime.launch import wait_until_serving

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    batch = max(DECODE_BATCHES)
    serve = [sys.executable, "-m", "radixlm.runtime.cli", "serve", "--model-path", path, "--port", str(port),
             "--load-format", "dummy", "--skip-tokenizer-init", "--device", DEVICE, "--attention-backend", "triton",
             "--dtype", "float32" if DRY else "bfloat16", "--max-total-tokens", str(batch * 512 + 4096)]
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", server, 900)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            done = subprocess.run([sys.executable, "-m", "radixlm.runtime.cli", "bench", "serve", "--base-url",
                                   f"http://127.0.0.1:{port}", "--num-prompts", str(batch), "--input-len",
                                   str(DECODE_PROMPT), "--output-len", str(DECODE_NEW), "--range-ratio", "0",
                                   "--vocab-size", str(SHAPE["vocab_size"]), "--output-json", out.name], capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
            with open(out.name) as f:
                summary = json.load(f)
    finally:
        server.terminate()
        server.wait(60)
    assert summary["completed"] == batch, summary["errors"]
    rows.append(f"| {batch} x ({DECODE_PROMPT} prompt + {DECODE_NEW} new), all at once | "
                f"{summary['output_tok_s']:.0f} | {summary['ttft_ms']['p50']:.0f} | {summary['tpot_ms']['p50']:.1f} |")


def kv_tier_round_trip(rows: list[str]) -> None:
    """The KV tier saves from the device's pool (a host copy made without waiting for the device)
    and a new engine, started on the same weights, reads the blocks back into it. (Weights saved
    to files: `dummy` ones are new each start, so no tier block could ever be read back.)"""
    import transformers

    from radixlm.runtime.local_engine import LocalEngine

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512)
    prompts = torch.randint(0, tiny["vocab_size"], (4, 128)).tolist()  # two 64-token blocks each
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    args = {**engine_args(), "load_format": "auto", "max_total_tokens": 4096}
    if DRY:  # the interpreter's Triton is slow, and the tier does not care which kernels wrote the KV
        args["attention_backend"] = "torch"
    with tempfile.TemporaryDirectory() as model, tempfile.TemporaryDirectory() as tier:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny)).save_pretrained(model)
        first = LocalEngine(model, kv_tier_path=tier, **args)
        before = first.generate(input_ids=prompts, sampling_params=params)
        store = first.scheduler.kv.tier.store
        first.shutdown()  # saves the tree's blocks and waits for the writes
        written, failed = store.stats.blocks_written, store.stats.writes_failed
        again = LocalEngine(model, kv_tier_path=tier, **args)
        after = again.generate(input_ids=prompts, sampling_params=params)
        loaded = again.scheduler.kv.tier.store.stats.tokens_loaded
        again.shutdown()
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(after, before))
    rows.append(f"| {DEVICE} pool | {written} | {failed} | {loaded} | {same}/{len(prompts)} |")
    assert written >= 8 and failed == 0 and loaded >= 4 * 64, (written, failed, loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--out", default=None, help="markdown file (default: benchmarks/results/gpu.md on a GPU)")
    args = ap.parse_args()
    if not DRY and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run")
    torch.manual_seed(0)
    device = "CPU (Triton interpreter, dry run)" if DRY else torch.cuda.get_device_name()
    out = args.out or (None if DRY else os.path.join(os.path.dirname(__file__), "results", "gpu.md"))
    lines = [f"# GPU check: {device}", "", f"torch {torch.__version__}, {DTYPE}, heads {HEADS}/{KV_HEADS} x {DIM}, page {PAGE}"]
    failed = []

    def section(title: str, header: list[str], fill) -> None:
        """One table: written out as soon as it is done, so a later section's failure (or the
        device's time running out) keeps it. On a GPU a failed section is recorded and the next one
        runs; the dry run (a test) fails at once."""
        start = time.perf_counter()
        lines.extend(["", f"## {title}", "", *header])
        try:
            fill(lines)
        except Exception:
            if DRY:
                raise
            import traceback

            failed.append(title)
            lines.extend(["", "**failed:**", "", "```", *traceback.format_exc().splitlines()[-25:], "```"])
        print("\n".join(lines[lines.index(f"## {title}") - 1:]), flush=True)
        print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
        if out:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")

    print(lines[0], flush=True)
    section("Correctness (relative error against the torch reference)", ["| kernel | shapes | rel. error |",
            "|---|---|---|"], check_correctness)
    bw = copy_bandwidth()
    section(f"Decode attention (copy bandwidth {bw / 1e9:.0f} GB/s)", ["| batch | context | ms | GB/s | of copy |",
            "|---|---|---|---|---|"], lambda rows: time_decode(rows, bw))
    default = extend_config(DIM, DTYPE, torch.device(DEVICE))
    section(f"Extend attention (causal; FLOP/s; {default.block_m}x{default.block_n}, {default.num_warps} warps, "
            f"{default.num_stages} stages)", ["| new tokens | cached prefix | ms | TFLOP/s | the best other config: "
            "TFLOP/s | torch SDPA TFLOP/s (ours/theirs) |", "|---|---|---|---|---|---|"], time_extend)
    with tempfile.TemporaryDirectory() as tmp:
        path = llama3_shape(tmp)
        section("End to end (random-weight Llama-3-8B shape)", ["| workload | wall s | output tok/s | total tok/s |",
                "|---|---|---|---|"], lambda rows: end_to_end(rows, path))
        section(f"Profile ({PROFILE_STEPS} steps each; the engine's defaults)",
                ["| workload | host ms a step | GPU busy ms a step | GPU idle | syncs a step | .item() a step |",
                 "|---|---|---|---|---|---|"], lambda rows: profile_steps(rows, path))
        graphs = "eager static batches (dry run)" if DRY else "CUDA graphs"
        section(f"Decode tokens/s by batch ({DECODE_PROMPT}-token prompts, {DECODE_NEW} new; vs graphs off, overlap off)",
                [f"| batch | {graphs} + overlap | {graphs}, no overlap | eager + overlap | eager, no overlap |",
                 "|---|---|---|---|---|"], lambda rows: decode_matrix(rows, path))
        section("KV tier round trip (blocks saved from the pool, read back by a new engine)",
                ["| pool | blocks written | writes failed | tokens read back | same tokens |", "|---|---|---|---|---|"],
                kv_tier_round_trip)
        section("radixlm bench serve (defaults: graphs and overlap on with CUDA)",
                ["| workload | output tok/s | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|"],
                lambda rows: bench_serve(rows, path))
    if failed:
        sys.exit(f"gpu check: {len(failed)} section(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
