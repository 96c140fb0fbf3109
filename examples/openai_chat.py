"""Talk to a running `radixlm serve` with the official OpenAI client (unchanged client code)."""

from __future__ import annotations

import sys

import openai


def main(base_url: str = "http://127.0.0.1:30000/v1") -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    question = "What is the capital of France? Answer in one sentence."
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0)
    print(f"Q: {question}\nA: {reply.choices[0].message.content}")
    print("A (streamed): ", end="")
    for chunk in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=32, temperature=0, stream=True):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print(f"\n[usage of the first call: {reply.usage.prompt_tokens} prompt, {reply.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    main(*sys.argv[1:])
