"""run_all's online section alone, quick sizes: `radixlm serve` (and llama-server, when a binary is
built) through bench serve's client, every workload a row with every request done; and the
shared-prefix groups it draws its system prompts from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from radixlm.runtime import bench_serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = ("one-stream", "no-sharing", "shared-prompts")


def test_shared_prefix_groups_interleave():
    requests = bench_serve.make_requests("shared-prefix", 8, 5, 3, 0.0, 20, seed=4, num_groups=4)
    prefixes = [tuple(r.prompt[:20]) for r in requests]
    assert len(set(prefixes)) == 4 and all(prefixes[i] == prefixes[i % 4] for i in range(8))
    assert all(len(r.prompt) == 25 and r.output_len == 3 for r in requests)
    assert len({tuple(r.prompt[20:]) for r in requests}) == 8  # each request its own question
    one = bench_serve.make_requests("shared-prefix", 8, 5, 3, 0.0, 20, seed=4)
    assert len({tuple(r.prompt[:20]) for r in one}) == 1


def test_run_all_online_quick(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--quick", "--only",
                           "online", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))  # no PYTHONPATH: kernels/ would shadow the installed `kernels`
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "online.json").read_text())
    assert saved["results"] == [] and not list(tmp_path.glob("*.png"))  # the offline section did not run
    llama = saved["meta"]["llama_cpp_version"] is not None  # a binary was found, so its rows must be there
    by = {(r["workload"], r["system"]): r for r in saved["online"]}
    assert set(by) == {(w, s) for w in WORKLOADS
                       for s in ("radixlm", "radixlm fp32", *(["llama.cpp"] if llama else []))}, set(by)
    for (w, s), r in by.items():
        summary = r["summary"]
        assert r["note"] == "" and summary["failed"] == 0, (w, s, r["note"])
        assert summary["output_tokens"] == r["expected_tokens"] > 0, (w, s)  # ignore_eos: every token made
        assert summary["output_tok_s"] > 0 and summary["request_throughput"] > 0, (w, s)
        for key in ("ttft_ms", "tpot_ms"):
            assert 0 < summary[key]["p50"] <= summary[key]["p99"], (w, s, key, summary[key])
    assert by[("shared-prompts", "radixlm")]["summary"]["cache_hit_rate"] > 0.3  # the groups' prompts are reused

    text = (tmp_path / "online.md").read_text()
    assert "## Online" in text and "CPU: " in text and "- radixlm: `" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(tuple(f"| {w} |" for w in WORKLOADS))]
    assert sorted((row[0][2:], row[2]) for row in rows) == sorted(by), rows  # one table row per result
    assert "- online no sharing, 32 streams, output tok/s vs llama.cpp" in text
    fp32_command = next(line for line in text.splitlines() if line.startswith("- radixlm fp32: `"))
    assert "--quantization none" in fp32_command  # the same server with fp32 weights, beside the default's
    assert "- online no sharing, 32 streams, output tok/s as served vs fp32 weights: " in text
    assert "not measured" not in text.split("as served vs fp32 weights: ")[1].splitlines()[0]
    if llama:
        assert "- llama.cpp: `" in text and "--no-repack" not in text  # its defaults, as released
        # which llama.cpp ran, beside each ratio against it (run_all.serving_llama_cpp)
        assert "online no sharing, 32 streams, output tok/s vs llama.cpp (its defaults): " in text
        assert "| radixlm / llama.cpp (its defaults) |" in text
    else:
        assert "no llama-server binary" in text
