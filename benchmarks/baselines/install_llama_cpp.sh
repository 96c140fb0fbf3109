#!/usr/bin/env bash
# Optional baseline: llama.cpp's `llama-server` (continuous batching over
# parallel slots, OpenAI-compatible) on the same GGUF file.
#
# Builds the server from the llama.cpp sources that llama-cpp-python's PyPI
# source distribution vendors (no network beyond the package registry), CPU
# only, into benchmarks/baselines/bin/llama-server. About 10-15 minutes on 2
# cores; needs gcc/g++, cmake and make. The benchmarks skip the llama.cpp rows
# with a printed note when the binary is missing (or use $LLAMA_SERVER).
#
#   bash benchmarks/baselines/install_llama_cpp.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
if [[ -x "$here/bin/llama-server" ]]; then
    echo "$here/bin/llama-server already built"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)"
mkdir -p "$here/bin"
cp "$work/build/bin/llama-server" "$here/bin/"
"$here/bin/llama-server" --version 2>&1 | tail -2
