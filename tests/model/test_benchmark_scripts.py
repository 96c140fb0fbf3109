"""The benchmark scripts' quick modes run and print their tables (the full runs are for people)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_micro_benchmarks_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "micro.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for title in ("## Radix cache", "## Scheduler overhead", "## This machine", "## SmolLM2-135M"):
        assert title in out
    radix = re.search(r"^\| 1000 \| (\d+) \| ([\d,]+) \| ([\d,]+) \|", out, re.M)
    assert radix and int(radix.group(1)) > 64  # the tree grew past the trunks
    ratios = [float(x) for x in re.findall(r"\| ([\d.]+)x \|$", out, re.M)]
    assert len(ratios) == 2 and all(r > 0.5 for r in ratios)  # no step beats the roofline floor by 2x


def test_few_shot_benchmark_quick():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "few_shot.py"), "--quick"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {m.group(1).strip(): (float(m.group(2)), m.group(3)) for m in re.finditer(
        r"^(radixlm[^|]*|hf static[^|]*)\|.*\| +([\d.]+)x \| +\d+% \| (\d+)%$", done.stdout, re.M)}
    assert set(rows) == {"radixlm", "radixlm, cache off", "hf static (batch 8)"}, done.stdout
    # the same scores pick the same options (one near-tie flip allowed); sharing the prefix is the speed
    assert all(int(same) >= 87 for _, same in rows.values()), done.stdout
    assert rows["radixlm"][0] > rows["radixlm, cache off"][0], done.stdout
