#!/usr/bin/env bash
# Set up, then generate with the embedded default model (SmolLM2-135M-Instruct) from the command line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- "What is the capital of France?" "Write a haiku about the sea."
fi
exec radixlm generate "$@"
