"""Run by test_sglang_frontend.py in a process of its own: SGLang's own frontend (`pip install
--no-deps sglang`), a client no one here wrote, runs the shared programs and SGLang-documented
native calls against a radixlm server, and prints what it got as JSON.

    python sglang_frontend_client.py http://127.0.0.1:30000
"""

from __future__ import annotations

import json
import sys

import requests
import sglang as sgl
from sglang_programs import backend, programs


def native_calls(url: str) -> dict:
    """/generate the way SGLang's docs show it: a batch, and a stream read as SGLang's are (each
    chunk's text is everything so far; print the part past what was printed)."""
    batch = requests.post(url + "/generate", json={
        "text": ["The capital of France is", "The capital of Japan is"],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    printed, pieces = 0, []
    with requests.post(url + "/generate", stream=True, json={
            "text": "The capital of France is", "stream": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}) as r:
        for chunk in r.iter_lines(decode_unicode=False):
            chunk = chunk.decode("utf-8")
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                data = json.loads(chunk[5:].strip("\n"))
                pieces.append(data["text"][printed:])
                printed = len(data["text"])
    return {"batch": [b["text"] for b in batch], "streamed": pieces}


def main(url: str) -> None:
    b = backend(sgl, url)
    sgl.set_default_backend(b)
    results = {name: p.run(b) for name, p in programs(sgl).items()}

    @sgl.function
    def streamed(s):
        s += "The capital of France is"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    results["text_iter"] = list(streamed.run(stream=True).text_iter("answer"))
    results["native"] = native_calls(url)
    results["server_info"] = sorted(b.get_server_info())
    b.flush_cache()  # raises unless the server flushed
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
