"""A server with overlap scheduling (`--overlap-schedule on`) under `--deterministic`: concurrent
requests, streamed ones cut off mid-way, and requests arriving while others decode give each
request bitwise the tokens it gets alone on the same server; the steps really overlapped, and
the KV accounting is clean after the aborts."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.conftest import LiveServer, assert_kv_clean

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time",
           "The best way to learn a language is", "Water boils at"]


@pytest.fixture(scope="module")
def overlap_server():
    srv = LiveServer("--overlap-schedule", "on", "--deterministic")
    yield srv
    assert srv.stop() == 0


def _generate(url: str, text: str, n: int) -> list[int]:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=120).json()["output_ids"]


async def _together(url: str, lens: list[int], cut: set[int]) -> list[list[int] | None]:
    """Every prompt at once, prompt i asking for lens[i] tokens, starting 0.1 s apart; the
    streams in `cut` are closed after their first chunks (the server aborts them)."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> list[int] | None:
            await asyncio.sleep(0.1 * i)
            body = {"text": PROMPTS[i], "sampling_params": {"max_new_tokens": lens[i], "temperature": 0,
                                                             "ignore_eos": True}}
            if i not in cut:
                return (await client.post(url + "/generate", json=body)).json()["output_ids"]
            async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as response:
                chunks = 0
                async for line in response.aiter_lines():
                    chunks += line.startswith("data:")
                    if chunks == 3:
                        return None  # leaving the block closes the connection mid-stream

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def test_overlapped_steps_give_each_request_its_tokens_alone(overlap_server):
    url = overlap_server.url
    lens = [24, 12, 30, 8, 20, 16]
    alone = [_generate(url, p, n) for p, n in zip(PROMPTS, lens)]
    before = httpx.get(url + "/get_server_info", timeout=30).json()
    got = asyncio.run(_together(url, [n + 40 if i in (1, 4) else n for i, n in enumerate(lens)], cut={1, 4}))
    for i, (g, a) in enumerate(zip(got, alone)):
        if g is not None:
            assert g == a, f"prompt {i}: {g} != alone {a}"
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["overlap_schedule"] is True
    assert info["overlapped_steps"] > before["overlapped_steps"], "no step was built while another ran"
    assert_kv_clean(url)
