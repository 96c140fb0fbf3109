"""What the Messages API, /tokenize, /v1/embeddings and /v1/rerank cost per request beside plain
chat generation: one `radixlm serve` (the defaults, SmolLM2), each path timed in turns on the
same prompt, medians of repeated calls, two rounds (the spread is the machine's noise). Last,
what /update_weights_from_disk takes with no request running (the same file again: read, laid
out for the kernels, swapped in, the cache flushed), three times.

    python benchmarks/api_cost.py
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time

import httpx

from radixlm.runtime.launch import wait_until_serving
from radixlm.runtime.model_config import default_model_path

PORT = 30117
URL = f"http://127.0.0.1:{PORT}"
MESSAGES = [{"role": "user", "content": "Name three colors and say why you like them."}]
DOCS = [f"Document {i}: " + "colors are nice to look at. " * 8 for i in range(8)]


def post(path: str, body: dict) -> None:
    r = httpx.post(URL + path, json=body, timeout=120)
    assert r.status_code == 200, r.text


CALLS = {
    "chat, 16 tokens": lambda: post("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 16,
                                                             "temperature": 0}),
    "messages, 16 tokens": lambda: post("/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": 16,
                                                         "temperature": 0}),
    "tokenize (chat template)": lambda: post("/tokenize", {"messages": MESSAGES}),
    "embeddings, 1 text": lambda: post("/v1/embeddings", {"input": MESSAGES[0]["content"]}),
    "chat, 1 token, each of 8 docs": lambda: [post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": d}], "max_tokens": 1}) for d in DOCS],
    "rerank, 8 docs": lambda: post("/v1/rerank", {"query": "Which colors are nice?", "documents": DOCS}),
}


def median_ms(call, n: int = 10) -> float:
    call()  # warm: the prompt in the cache, as in steady use
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    server = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "serve", "--port", str(PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(URL, server)
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
        print(f"CPU: {cpu}\n\n| call | round 1 (ms) | round 2 (ms) |\n|---|---|---|")
        rounds = [{name: median_ms(call) for name, call in CALLS.items()} for _ in range(2)]
        for name in CALLS:
            print(f"| {name} | {rounds[0][name]:.1f} | {rounds[1][name]:.1f} |")
        path = default_model_path()  # what the server serves (it was started without --model-path)
        updates = []
        for _ in range(3):
            started = time.perf_counter()
            post("/update_weights_from_disk", {"model_path": path})
            updates.append((time.perf_counter() - started) * 1e3)
        print(f"\n/update_weights_from_disk (the served file again, idle): {', '.join(f'{u:.0f}' for u in updates)} ms")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)


if __name__ == "__main__":
    main()
