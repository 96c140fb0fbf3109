"""A live server on a free port, started once per test session (SmolLM2, the default model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from helpers import MODULE_CWD
from radixlm.runtime.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def all_gone(pids, timeout=10.0) -> bool:
    """Whether every process in `pids` has exited within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


class LiveServer:
    def __init__(self, *extra: str, launcher: tuple[str, ...] = ("-m", "radixlm.runtime.cli"), port: int | None = None) -> None:
        """`launcher`: what python runs, given the `serve ...` arguments (a test double can stand in)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if "--quantization" not in extra:  # the weights HF runs, so outputs compare with it
            extra = ("--quantization", "none", *extra)
        cmd = [sys.executable, *launcher, "serve", "--port", str(self.port), "--max-total-tokens", "30000", *extra]
        self.log_path = f"/tmp/radixlm-test-server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=MODULE_CWD, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 300) -> None:
        from radixlm.runtime.launch import wait_until_serving

        try:
            wait_until_serving(self.url, self.proc, timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self.output()}") from None

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def child_pids(self, of: int | None = None) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(of or self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def descendant_pids(self) -> list[int]:
        found, stack = [], [self.proc.pid]
        while stack:
            children = self.child_pids(stack.pop())
            found += children
            stack += children
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def assert_kv_clean(url: str, wait: float = 10) -> None:
    """Once the server is idle (within `wait` seconds), the KV accounting identity holds and
    nothing is locked."""
    deadline = time.time() + wait
    while True:
        acct = httpx.get(url + "/debug/kv_accounting", timeout=30).json()
        assert acct["ok"], acct
        if acct["idle"] or time.time() > deadline:
            break
        time.sleep(0.1)
    assert acct["idle"], f"server still busy: {acct}"
    assert acct["locked_pages"] == 0, acct
    assert acct["free_pages"] + acct["evictable_pages"] == acct["pool_pages"], acct

