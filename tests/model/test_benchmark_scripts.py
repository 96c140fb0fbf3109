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
