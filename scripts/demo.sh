#!/usr/bin/env bash
# Set up, serve the embedded default model (SmolLM2-135M-Instruct), run one native request with
# curl, an OpenAI-client example and a program in the language against it, then stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-30000}
radixlm serve --port "$PORT" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server failed to start" >&2; exit 1; }
    sleep 1
done
echo "--- native /generate:"
curl -s "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
    -d '{"text": "The three primary colours are", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}'
echo
echo "--- OpenAI API (examples/openai_chat.py):"
"${PYTHON:-python3}" examples/openai_chat.py "http://127.0.0.1:$PORT/v1"
echo "--- tool calling over the OpenAI API (examples/openai_tools.py):"
"${PYTHON:-python3}" examples/openai_tools.py "http://127.0.0.1:$PORT/v1"
echo "--- a program in the language (examples/multi_turn_agent.py):"
"${PYTHON:-python3}" examples/multi_turn_agent.py --url "http://127.0.0.1:$PORT"
