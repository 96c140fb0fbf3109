#!/usr/bin/env bash
# The GPU check: Triton kernels' correctness and timing against the roofline, then end-to-end
# throughput; writes benchmarks/results/gpu.md. `--dry-run` runs the same code paths on tiny
# shapes under the Triton interpreter (any machine; CI runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
