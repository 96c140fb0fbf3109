"""`radixlm router`: start the replicas it was asked to (`--dp-size`), then serve the router."""

from __future__ import annotations

import logging
import subprocess
import sys

import uvicorn

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.launch import free_port
from radixlm.runtime.router.router import Router, create_router_app
from radixlm.runtime.server.launch_server import wait_until_serving

log = logging.getLogger("radixlm.router")


def run_router(urls: list[str], dp_size: int, args: ServerArgs, policy: str, host: str, port: int,
               api_key: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    replicas = [start_replica(args) for _ in range(dp_size)]
    try:
        for url, proc in replicas:
            wait_until_serving(url, proc)
        router = Router(list(urls) + [url for url, _ in replicas], policy)
        print(f"radixlm router on http://{host}:{port} over {len(router.replicas)} replicas ({policy})", flush=True)
        uvicorn.run(create_router_app(router, api_key), host=host, port=port, log_level="warning")
        return 0
    finally:
        for _, proc in replicas:
            proc.terminate()
        for _, proc in replicas:
            proc.wait(30)


def start_replica(args: ServerArgs) -> tuple[str, subprocess.Popen]:
    """A `radixlm serve` on a free local port with these options; (its URL, its process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.cli", "serve", "--port", str(port), *args.to_cli_args()])
    return f"http://127.0.0.1:{port}", proc
