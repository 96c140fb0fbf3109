"""`radixlm bench serve` against the live server, through both APIs."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime import bench_serve, cli
from server.conftest import assert_kv_clean


@pytest.mark.parametrize("backend", ["native", "openai"])
def test_bench_serve_reports_every_request(server, tmp_path, backend):
    out = tmp_path / "summary.json"
    args = ["--dataset", "shared-prefix", "--num-prompts", "6", "--input-len", "16", "--output-len", "6",
            "--prefix-len", "64", "--seed", "3"]
    rc = cli.main(["bench", "serve", "--base-url", server.url, "--backend", backend, "--request-rate", "20",
                   "--max-concurrency", "3", "--output-json", str(out), *args])
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["completed"] == 6 and summary["failed"] == 0
    expected = bench_serve.make_requests("shared-prefix", 6, 16, 6, 0.5, 64, 3)
    assert summary["output_tokens"] == sum(r.output_len for r in expected)  # ignore_eos: every token is generated
    assert summary["input_tokens"] == sum(len(r.prompt) for r in expected)
    assert summary["cache_hit_rate"] > 0.3  # the 64-token prefix is shared after the first request
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = summary[key]
        assert 0 < m["p50"] <= m["p90"] <= m["p99"], (key, m)
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert_kv_clean(server.url)


def test_bench_serve_counts_failures(tmp_path):
    outcomes, duration = __import__("asyncio").run(bench_serve.run(
        "http://127.0.0.1:9", "native", bench_serve.make_requests("random", 2, 8, 2, 0.0, 0, 0), float("inf"), None))
    summary = bench_serve.summarize(outcomes, duration)
    assert summary["completed"] == 0 and summary["failed"] == 2 and summary["errors"]
