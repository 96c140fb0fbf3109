"""Soak: thousands of mixed requests in bursts beyond the KV pool, with clients that walk away.

    python benchmarks/soak.py                 # 2,000 requests against a fresh server (a few minutes)
    python benchmarks/soak.py --quick         # 140 requests (CI: tests/server/test_soak.py)
    python benchmarks/soak.py --url http://127.0.0.1:30000 --requests 5000   # an already running server

The mix (seeded): native /generate, OpenAI completions and chat, and the
Responses API; half streamed;
one in six constrained (regex or JSON schema, the same few over and over, so
many requests wait on one compile); a quarter of the chats offer a tool
(`tool_choice` auto or required); one in five has stop strings; one in eight
asks for n = 2 or 3 samples under a seed; prompts share one of four long
system prompts; 30% of streams are dropped after a few events and 6% of the
others time out on the client side; about 4% are bad requests that must get a 400
(a negative length, or a regex that does not compile, sent by many at once).
Requests arrive in bursts (up to --burst at once) that need far more KV than the
pool holds (the server it starts gets --max-total-tokens 2048), so requests
queue and running ones may be retracted. That server runs the features together:
its default precision, n-gram speculation, a reasoning parser, and a KV tier in a
temporary folder that the evicted system prompts go to and come back from.

Every request must end in exactly one expected way: complete, dropped by its
client, or refused as bad. Anything else (an error, a 5xx, a stream without its
end, a request still unanswered at the deadline) counts as lost. After the
drain the server's KV accounting must hold with no page locked or leaked.
Printed, and written as JSON to --out: requests, outcomes, lost, leaked pages,
latency p50/p99 of completed requests, retractions, and the server's RSS after
warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.append(ROOT)  # after site-packages: kernels/ must not shadow the installed `kernels`
from radixlm.runtime.launch import free_port, wait_until_serving  # noqa: E402

SYSTEM_PROMPTS = [
    "You are a careful assistant for a hardware store. " + "Answer briefly and name the aisle. " * 25,
    "You translate English into plain French. " + "Keep the tone polite and the words simple. " * 25,
    "You are a math tutor. " + "Show one step at a time and check the arithmetic twice. " * 25,
    "You summarize support tickets. " + "List the product, the problem and the urgency. " * 25,
]
REGEX = r"[0-9]{1,3}( [a-z]+){1,3}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "qty": {"type": "integer"}}, "required": ["name", "qty"]}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Find an item in the catalogue",
                                         "parameters": SCHEMA}}
EXPECTED = ("ok", "dropped", "refused")


@dataclass
class Plan:
    api: str  # native | completions | chat | responses
    stream: bool
    constraint: str | None  # regex | json | None
    prompt: str
    max_tokens: int
    drop_after: int | None  # streams: close after this many events
    client_timeout: float | None  # non-streams: give up after this many seconds
    bad: bool
    tool_choice: str | None = None  # chat only: auto | required
    stop: list[str] | None = None
    n: int = 1


def make_plans(n: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        stream = rng.random() < 0.5
        bad = rng.random() < 0.02 or i % 50 == 17  # about 4%, at least one in every 50 (a short run has some)
        plans.append(Plan(
            api=rng.choice(["native", "native", "completions", "chat", "responses"]),
            stream=stream,
            constraint=rng.choice(["regex", "json"]) if rng.random() < 1 / 6 else None,
            prompt=f"{rng.choice(SYSTEM_PROMPTS)}\nRequest {i}: tell me about item {rng.randrange(10**6)}.",
            max_tokens=rng.randint(4, 24),
            drop_after=rng.randint(1, 2) if stream and not bad and rng.random() < 0.3 else None,
            client_timeout=rng.uniform(0.05, 0.5) if not stream and not bad and rng.random() < 0.06 else None,
            bad=bad,
        ))
        if plans[-1].api == "chat" and rng.random() < 0.25:
            plans[-1].tool_choice = rng.choice(["auto", "required"])
            if plans[-1].tool_choice == "required":
                plans[-1].constraint = None  # a forced call and another constraint are refused together
        if rng.random() < 0.2:
            plans[-1].stop = rng.choice([["."], ["\n", " the "], ["aisle"]])
        if rng.random() < 0.125:
            plans[-1].n = rng.randint(2, 3)
        if bad and rng.random() < 0.5:
            plans[-1].constraint = "bad-regex"
        if plans[-1].api == "responses":  # no n, stop strings or regexes there
            plans[-1].n, plans[-1].stop = 1, None
            if plans[-1].constraint in ("regex", "bad-regex"):
                plans[-1].constraint = None
    return plans


CONSTRAINTS = {"regex": {"regex": REGEX}, "json": {"json_schema": json.dumps(SCHEMA)},
               "bad-regex": {"regex": "([0-9]+"}}


def body_of(p: Plan) -> tuple[str, dict]:
    # a bad request: a negative length or a regex that does not compile; the server must say 400
    limit = -1 if p.bad and p.constraint != "bad-regex" else p.max_tokens
    extra = {**CONSTRAINTS.get(p.constraint, {}), **({"stop": p.stop} if p.stop else {})}
    if p.n > 1:
        extra.update(n=p.n, seed=p.max_tokens)
    if p.api == "native":
        params: dict = {"max_new_tokens": limit, "temperature": 0.7, **extra}
        return "/generate", {"text": p.prompt, "sampling_params": params, "stream": p.stream}
    if p.api == "responses":
        body = {"model": "default", "max_output_tokens": limit, "temperature": 0.7, "stream": p.stream,
                "instructions": p.prompt.split("\n")[0], "input": p.prompt.split("\n")[1]}
        if p.constraint == "json":
            body["text"] = {"format": {"type": "json_schema", "name": "item", "schema": SCHEMA}}
        return "/v1/responses", body
    body: dict = {"model": "default", "max_tokens": limit, "temperature": 0.7, "stream": p.stream, **extra}
    if p.api == "chat":
        if p.tool_choice:
            body["tools"], body["tool_choice"] = [TOOL], p.tool_choice
        body["messages"] = [{"role": "system", "content": p.prompt.split("\n")[0]},
                            {"role": "user", "content": p.prompt.split("\n")[1]}]
        return "/v1/chat/completions", body
    body["prompt"] = p.prompt
    return "/v1/completions", body


def finished(obj: dict | list) -> set[int]:
    """The sample indices a response (or a stream event) carries a finish reason for."""
    if isinstance(obj, list):  # native, n > 1
        return set().union(*({i} if finished(o) else set() for i, o in enumerate(obj)))
    if "meta_info" in obj:
        return {obj.get("index", 0)} if obj["meta_info"].get("finish_reason") is not None else set()
    if obj.get("object") == "response":  # the Responses API, whole
        return {0} if obj.get("status") in ("completed", "incomplete") else set()
    if obj.get("type", "").startswith("response."):  # its stream: the last event ends it
        return {0} if obj["type"] in ("response.completed", "response.incomplete") else set()
    return {c.get("index", 0) for c in obj.get("choices", []) if c.get("finish_reason")}


async def send(client: httpx.AsyncClient, p: Plan, deadline: float) -> tuple[str, float, str]:
    """(outcome, seconds, detail): outcome is ok | dropped | refused | lost."""
    path, body = body_of(p)
    start = time.perf_counter()
    try:
        if not p.stream:
            timeout = p.client_timeout or deadline
            try:
                r = await client.post(path, json=body, timeout=timeout)
            except httpx.TimeoutException:
                return ("dropped", 0.0, "") if p.client_timeout else ("lost", 0.0, "no answer by the deadline")
            if p.bad:
                return ("refused", 0.0, "") if r.status_code == 400 else ("lost", 0.0, f"bad request got {r.status_code}")
            if r.status_code != 200 or len(finished(r.json())) != p.n:
                return "lost", 0.0, f"{r.status_code}: {r.text[:200]}"
            return "ok", time.perf_counter() - start, ""
        async with client.stream("POST", path, json=body, timeout=deadline) as r:
            if p.bad:
                return ("refused", 0.0, "") if r.status_code == 400 else ("lost", 0.0, f"bad request got {r.status_code}")
            if r.status_code != 200:
                return "lost", 0.0, f"{r.status_code}: {(await r.aread())[:200]!r}"
            events, ended, done = 0, set(), False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event or event.get("type") == "response.failed":
                    return "lost", 0.0, f"error event: {event.get('error') or event['response']['error']}"
                ended |= finished(event)
                if p.api == "responses" and ended:  # (no [DONE] there)
                    done = True
                events += 1
                if p.drop_after is not None and events >= p.drop_after:
                    return "dropped", 0.0, ""  # leaving the block closes the connection mid-stream
            if not done or len(ended) != p.n:
                return "lost", 0.0, f"the stream ended without [DONE] or a finish reason for each of {p.n}"
            return "ok", time.perf_counter() - start, ""
    except httpx.HTTPError as e:
        return "lost", 0.0, f"{type(e).__name__}: {e}"


async def run_load(url: str, plans: list[Plan], burst: int, seed: int, deadline: float,
                   on_progress=None, peaks: dict | None = None) -> list[tuple[str, float, str]]:
    rng = random.Random(seed + 1)
    results: list[tuple[str, float, str] | None] = [None] * len(plans)
    limits = httpx.Limits(max_connections=2 * burst, max_keepalive_connections=burst)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        async def watch() -> None:  # the most requests running and waiting at once
            while True:
                info = (await client.get("/get_server_info", timeout=30)).json()
                for key in ("running_requests", "waiting_requests"):
                    peaks[key] = max(peaks.get(key, 0), info[key])
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch()) if peaks is not None else None
        async def one(i: int) -> None:
            results[i] = await send(client, plans[i], deadline)

        tasks, i = [], 0
        while i < len(plans):
            size = rng.randint(1, burst)  # a burst, then a pause long enough to half drain or not
            tasks += [asyncio.create_task(one(j)) for j in range(i, min(i + size, len(plans)))]
            i += size
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            while sum(not t.done() for t in tasks) > 2 * burst:  # the client itself stays bounded
                await asyncio.sleep(0.1)
            if on_progress:
                on_progress(i)
        await asyncio.gather(*tasks)
        if watcher is not None:
            watcher.cancel()
    return results  # type: ignore[return-value]


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        stack += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            pass
    return total


def drained_accounting(url: str, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while True:
        acct = httpx.get(url + "/debug/kv_accounting", timeout=30).json()
        if acct.get("idle") or time.time() > deadline:
            return acct
        time.sleep(0.2)


class Server:
    def __init__(self, extra: list[str]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/radixlm-soak-{port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "serve", "--port", str(port), *extra],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until_serving(self.url, self.proc)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {self.log.name}") from None

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(30)
        self.log.close()
        return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="140 requests, smaller bursts, a shorter warm-up (CI)")
    ap.add_argument("--burst", type=int, default=96, help="most requests arriving at once")
    ap.add_argument("--url", default=None, help="soak a running server instead of starting one")
    ap.add_argument("--server-args", default="--max-total-tokens 2048 --speculative ngram --reasoning-parser qwen3",
                    help="options of the server this script starts (a KV tier in a temporary folder is added)")
    ap.add_argument("--deadline", type=float, default=300, help="seconds after which an unanswered request is lost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    ns = ap.parse_args()
    if ns.quick:
        ns.requests, ns.burst = 140, 48

    tier = None if ns.url else tempfile.TemporaryDirectory(prefix="radixlm-soak-tier-")
    server = None if ns.url else Server([*ns.server_args.split(), "--kv-tier-path", tier.name])
    url = ns.url or server.url
    pid = server.proc.pid if server else None
    plans = make_plans(ns.requests, ns.seed)
    try:
        # warm-up: the first constraint compile, the first batches; RSS is measured after it
        asyncio.run(run_load(url, make_plans(20 if ns.quick else 40, ns.seed + 100), 20, ns.seed, ns.deadline))
        drained_accounting(url)
        rss_start = tree_rss_mb(pid) if pid else None
        before = httpx.get(url + "/get_server_info", timeout=30).json()
        t0 = time.perf_counter()

        def progress(sent: int) -> None:
            print(f"\r  {sent}/{len(plans)} sent, {time.perf_counter() - t0:.0f}s", end="", file=sys.stderr, flush=True)

        peaks: dict = {}
        results = asyncio.run(run_load(url, plans, ns.burst, ns.seed, ns.deadline, progress, peaks))
        wall = time.perf_counter() - t0
        print(file=sys.stderr)
        acct = drained_accounting(url)
        after = httpx.get(url + "/get_server_info", timeout=30).json()
        rss_end = tree_rss_mb(pid) if pid else None
    finally:
        code = server.stop() if server else 0
        if tier is not None:
            tier.cleanup()

    counts = {k: sum(r[0] == k for r in results) for k in (*EXPECTED, "lost")}
    latencies = [r[1] for r in results if r[0] == "ok"]
    leaked = acct["pool_pages"] - acct["free_pages"] - acct["evictable_pages"]
    summary = {
        "requests": len(plans), "wall_s": round(wall, 1), **counts,
        "dropped_share": round(counts["dropped"] / len(plans), 3),
        "streamed": sum(p.stream for p in plans), "constrained": sum(p.constraint is not None for p in plans),
        "with_tools": sum(p.tool_choice is not None for p in plans),
        "with_stop": sum(p.stop is not None for p in plans), "with_n": sum(p.n > 1 for p in plans),
        "responses_api": sum(p.api == "responses" for p in plans),
        "speculative": after.get("speculative_stats"), "kv_tier": after.get("kv_tier"),
        "kv_accounting_ok": acct["ok"], "idle_after_drain": acct["idle"],
        "locked_pages_after": acct["locked_pages"], "leaked_pages": leaked,
        "peak_running": peaks.get("running_requests"), "peak_waiting": peaks.get("waiting_requests"),
        "retractions": after["num_retractions"] - before["num_retractions"],
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
        "latency_p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
        "rss_start_mb": round(rss_start, 1) if rss_start else None,
        "rss_end_mb": round(rss_end, 1) if rss_end else None,
        "rss_drift": round(rss_end / rss_start - 1, 4) if rss_start and rss_end else None,
        "server_exit_code": code,
        "lost_examples": [r[2] for r in results if r[0] == "lost"][:5],
    }
    width = max(map(len, summary))
    for k, v in summary.items():
        print(f"{k:<{width}}  {v}")
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(summary, f, indent=1)
    tier_failures = (after.get("kv_tier") or {}).get("writes_failed", 0)
    ok = (counts["lost"] == 0 and leaked == 0 and acct["ok"] and acct["idle"] and acct["locked_pages"] == 0
          and code == 0 and tier_failures == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
