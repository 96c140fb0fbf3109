"""`radixlm serve`: the process group plus the HTTP server, with a watchdog and clean shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import subprocess
import threading
import time

import uvicorn

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.client import RuntimeClient
from radixlm.runtime.launch import RuntimeProcesses, launch_processes
from radixlm.runtime.worker.loader import resolve_model
from radixlm.runtime.server.http_server import MAX_REQUEST_BYTES, ServerState, create_app

log = logging.getLogger("radixlm.server")


def serve(args: ServerArgs, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          max_request_bytes: int | None = None, max_queued_requests: int | None = None) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until a runtime process dies (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    group = launch_processes(args)
    if args.node_rank > 0:
        return _serve_ranks(args, group)
    try:
        model_name = args.served_model_name or resolve_model(args.model_path).name
        info = {**group.info, "client_address": group.client_address}  # for local clients that attach (ZeroMQ)
        client = RuntimeClient(group.client_address)
        if max_queued_requests is not None:
            client.max_in_flight = args.max_running_requests + max_queued_requests
        state = ServerState(client, info, dataclasses.asdict(args), model_name)
        app = create_app(state, api_key, max_request_bytes or MAX_REQUEST_BYTES)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)
        server = uvicorn.Server(config)

        def watchdog() -> None:
            announced = False
            while not server.should_exit:
                if server.started and not announced:
                    announced = True
                    print(f"radixlm ready on http://{host}:{port} ({group.info.get('architecture')}, "
                          f"{group.info.get('max_total_tokens')} KV tokens)", flush=True)
                dead = group.dead_process()
                if dead:
                    log.error("runtime process died: %s; shutting down", dead)
                    state.dead = dead
                    server.should_exit = True
                    return
                time.sleep(0.2)

        threading.Thread(target=watchdog, name="radixlm-watchdog", daemon=True).start()
        # uvicorn re-raises the signal that stopped it; turn that into a normal exit so the
        # children are stopped below
        signal.signal(signal.SIGTERM, _exit_quietly)
        try:
            asyncio.run(server.serve())
        except KeyboardInterrupt:
            pass
        return 1 if state.dead else 0
    finally:
        group.shutdown()


def _serve_ranks(args: ServerArgs, group: RuntimeProcesses) -> int:
    """A node other than 0: its tensor-parallel ranks follow node 0's scheduler; no API here. Runs
    until SIGINT/SIGTERM (exit 0) or until a rank stops, e.g. because node 0 went away (exit 1)."""
    ranks = args.local_ranks
    print(f"radixlm node {args.node_rank}: tensor-parallel ranks {ranks.start}-{ranks.stop - 1} joined "
          f"{args.dist_init_addr}", flush=True)
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        while (dead := group.dead_process()) is None:
            time.sleep(0.2)
        log.error("runtime process died: %s; shutting down", dead)
        return 1
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        group.shutdown()


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Block until the server `proc` started answers /health at `url`; raises RuntimeError if it
    exits first or does not answer within `timeout` seconds (for scripts and tests that start one)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {timeout:.0f}s")
