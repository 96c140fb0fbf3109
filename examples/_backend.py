"""The backend an example runs on: a server's URL (default), or `--local` to start a runtime in-process group."""

from __future__ import annotations

import argparse

import radixlm as rl


def backend_from_args(description: str) -> rl.Backend:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="a running `radixlm serve`")
    ap.add_argument("--local", action="store_true", help="start a runtime in the background instead (ZeroMQ)")
    args = ap.parse_args()
    return rl.Runtime() if args.local else rl.RuntimeEndpoint(args.url)
