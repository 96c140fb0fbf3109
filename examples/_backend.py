"""The backend an example runs on: a server's URL (default), or `--local` to start a runtime in-process group."""

from __future__ import annotations

import argparse

import frontend_lang as fl


def backend_from_args(description: str) -> fl.Backend:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="a running `radixlm serve`")
    ap.add_argument("--local", action="store_true", help="start a runtime in the background instead (ZeroMQ)")
    args = ap.parse_args()
    return fl.Runtime() if args.local else fl.RuntimeEndpoint(args.url)
