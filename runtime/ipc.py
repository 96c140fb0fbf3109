"""ZeroMQ plumbing: private socket paths, and messages as tagged orjson (never pickle)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import tempfile
from typing import Any

import orjson
import zmq

from radixlm.runtime import messages
from radixlm.runtime.sampling_params import SamplingParams

_TYPES = {
    cls.__name__: cls
    for cls in (
        messages.GenerateRequest, messages.AbortRequest, messages.ControlRequest, messages.ClientOutput,
        messages.ControlOutput, messages.TokenizedRequest, messages.TokenOutput, messages.BatchTokenOutput,
        messages.SchedulerLimits,
    )
}


def encode(msg: Any) -> bytes:
    # logit_bias has int keys
    return orjson.dumps({"type": type(msg).__name__, "data": _plain(msg)}, option=orjson.OPT_NON_STR_KEYS)


def decode(raw: bytes) -> Any:
    obj = orjson.loads(raw)
    cls = _TYPES.get(obj.get("type"))
    if cls is None:
        raise ValueError(f"unknown message type {obj.get('type')!r}")
    return _build(cls, obj["data"])


def _plain(msg: Any) -> Any:
    if isinstance(msg, SamplingParams):
        return msg.to_dict()
    if dataclasses.is_dataclass(msg):  # a field not given stays out: it is not given at the other end either
        return {f.name: _plain(v) for f in dataclasses.fields(msg)
                if (v := getattr(msg, f.name)) is not messages.CONSTRAINT_NOT_GIVEN}
    if isinstance(msg, (list, tuple)):
        return [_plain(x) for x in msg]
    return msg


def _build(cls: type, data: dict[str, Any]) -> Any:
    if cls is messages.TokenizedRequest:
        data = dict(data, sampling_params=SamplingParams.from_dict(data["sampling_params"]))
    elif cls is messages.BatchTokenOutput:
        data = {"outputs": [messages.TokenOutput(**o) for o in data["outputs"]]}
    return cls(**data)


def private_ipc_dir() -> str:
    """A fresh 0700 directory for the runtime's socket files (only this user can connect)."""
    path = tempfile.mkdtemp(prefix="radixlm-")
    os.chmod(path, 0o700)
    return path


def endpoint(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


def socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.ROUTER, zmq.DEALER):
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of outputs
    if kind in (zmq.PULL, zmq.ROUTER, zmq.DEALER):
        sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(address)
    return sock


def die_with_parent(name: str) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a killed server leaves no orphans;
    and name it (`ps`, `top` and /proc/PID/comm show `name`, at most 15 bytes)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
