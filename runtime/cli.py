"""The `radixlm` command: `generate`, `serve`, `bench serve`."""

from __future__ import annotations

import argparse
import os
import sys
import time

from radixlm.runtime.args import ServerArgs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixlm", description="prefix-sharing LLM runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts from the command line")
    gen.add_argument("prompts", nargs="+", help="one or more prompts (run as one batch)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    ServerArgs.add_cli_args(gen)
    srv = sub.add_parser("serve", help="serve the model over HTTP (SGLang-native and OpenAI APIs)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    srv.add_argument("--api-key", default=os.environ.get("RADIXLM_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                          "(default: $RADIXLM_API_KEY; the variable keeps the key out of the process list)")
    srv.add_argument("--max-request-bytes", type=int, default=None, help="largest request body accepted (default 32 MiB)")
    srv.add_argument("--no-webui", action="store_true", help="serve no web page at / (the chat playground and dashboard)")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="requests that may wait beyond --max-running-requests; more get 503 + Retry-After "
                          "(default: no limit)")
    ServerArgs.add_cli_args(srv)
    from radixlm.runtime.router import POLICIES

    rt = sub.add_parser("router", help="one API over several replicas, each request sent where its prefix is cached")
    rt.add_argument("--worker-urls", nargs="*", default=[], help="replicas already running (radixlm serve URLs)")
    rt.add_argument("--dp-size", type=int, default=0,
                    help="start this many replicas on this machine, with the runtime options given here")
    rt.add_argument("--policy", choices=POLICIES, default="cache_aware")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=30000)
    rt.add_argument("--api-key", default=os.environ.get("RADIXLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every router endpoint but /health "
                         "(default: $RADIXLM_API_KEY); replicas it starts get no key: they listen on 127.0.0.1")
    ServerArgs.add_cli_args(rt)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_serve_parser = bench.add_parser("serve", help="online serving benchmark against a running server")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its module imports numpy and httpx: time every `serve` would pay before it starts
        from radixlm.runtime import bench_serve

        bench_serve.add_cli_args(bench_serve_parser)
    ns = parser.parse_args(argv)
    if ns.command == "bench":
        from radixlm.runtime import bench_serve

        return bench_serve.main(ns)
    if ns.command == "generate":
        return _generate(ns)
    if ns.command == "router":
        if not ns.worker_urls and ns.dp_size < 1:
            parser.error("give --worker-urls or --dp-size")
        from radixlm.runtime.launch import run_router

        return run_router(ns.worker_urls, ns.dp_size, ServerArgs.from_cli_args(ns), ns.policy, ns.host, ns.port,
                          ns.api_key)
    if ns.command == "serve":
        if (ns.max_queued_requests or 0) < 0 or (ns.max_request_bytes is not None and ns.max_request_bytes < 1):
            parser.error("--max-queued-requests must be >= 0 and --max-request-bytes >= 1")
        from radixlm.runtime.launch import serve

        return serve(ServerArgs.from_cli_args(ns), ns.host, ns.port, ns.api_key, ns.max_request_bytes,
                     ns.max_queued_requests, webui=not ns.no_webui)
    return 2


def _generate(ns: argparse.Namespace) -> int:
    from radixlm.runtime.local_engine import LocalEngine

    engine = LocalEngine(**vars(ServerArgs.from_cli_args(ns)))
    prompts = ns.prompts if ns.raw else [engine.apply_chat_template([{"role": "user", "content": p}]) for p in ns.prompts]
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "seed": ns.seed}
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, res in zip(ns.prompts, results):
        print(f"### {prompt}\n{res['text']}\n")
        tokens += res["meta_info"]["completion_tokens"]
    print(f"[{len(results)} prompt(s), {tokens} tokens in {elapsed:.2f}s, {tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
