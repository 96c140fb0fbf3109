"""`scripts/gpu_check.sh --dry-run`: the GPU check's code paths on tiny shapes under the interpreter."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_dry_run_prints_every_table():
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for title in ("## Correctness", "## Decode attention", "## Extend attention", "## End to end", "## Profile",
                  "## Decode tokens/s by batch", "## KV tier round trip", "## radixlm bench serve"):
        assert title in out
    # every batch of the decode matrix has its four configurations, each a rate and a ratio
    matrix = re.findall(r"^\| (\d+) \| (\d+ \([0-9.]+x\) \| ){3}\d+ \([0-9.]+x\) \|$", out, re.M)
    assert [b for b, _ in matrix] == ["3"], out
    # extend attention beside the best of the other configurations (the dry run has one)
    extend = re.findall(r"^\| 32 \| (0|32) \| [0-9.]+ \| [0-9.]+ \| 32x16, 4 warps, 1 stages: [0-9.]+ \| .+ \|$", out, re.M)
    assert extend == ["0", "32"], out
    # the profile: each workload's step costs, and its top ops with their share of the busy time
    steps = re.findall(r"^\| (decode, batch 3|prefill, 2 x 32 tokens \(first step\)) \| ([0-9.]+) \| ([0-9.]+) \| "
                       r"(\d+)% \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert [s[0] for s in steps] == ["decode, batch 3", "prefill, 2 x 32 tokens (first step)"], out
    assert all(float(s[1]) > 0 and float(s[2]) > 0 for s in steps), steps
    tops = re.findall(r"^\| (decode, batch 3|prefill, 2 x 32 tokens \(first step\)) \| `aten::\w+` \| ([0-9.]+) \| (\d+)% \|$",
                      out, re.M)
    assert [t[0] for t in tops] == ["decode, batch 3"] * 5 + ["prefill, 2 x 32 tokens (first step)"] * 5, out
    assert all(0 < int(t[2]) <= 100 for t in tops), tops
    assert re.search(r"^\| cpu pool \| (\d+) \| 0 \| (\d+) \| 4/4 \|$", out, re.M), out
    assert re.search(r"^\| 3 x \(16 prompt \+ 4 new\), all at once \| \d+ \|", out, re.M), out
    errors = [float(x) for x in re.findall(r"^\| (?:extend|decode) \|.*\| ([0-9.e+-]+) \|$", out, re.M)]
    assert len(errors) == 2 and max(errors) < 1e-5, out
