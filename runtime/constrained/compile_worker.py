"""A child process that compiles constraints (a backend's `Builder`, backend.py), so that one whose automaton
explodes (`(a|b)*a(a|b){30}` has 2^30 states; each level of nested arrays in a JSON schema
quadruples its regex) can be stopped: a thread cannot be, a process can be killed. Its address
space is capped too, so such a constraint fails alone instead of drawing the OOM killer.

Protocol over the child's stdin/stdout (a private pipe between our own processes): each message is
an 8-byte little-endian length and a pickle. The parent sends the backend's Builder once (it holds the
vocabulary), which the child acknowledges with ("ready", None) once loaded (imports included: its start
is not charged to the first constraint's time limit), then constraint keys; the child answers each with
("ok", what Builder.build returned) or ("error", message). EOF on stdin ends it.
"""

from __future__ import annotations

import pickle
import resource
import struct
import subprocess
import sys
from typing import IO, Any

MEMORY_LIMIT_BYTES = 8 << 30  # address space of one compiler process
_LEN = struct.Struct("<Q")


def write_message(stream: IO[bytes], obj: Any) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(blob)) + blob)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message; raises EOFError when the other side is gone."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    size = _LEN.unpack(head)[0]
    blob = stream.read(size)
    if len(blob) < size:
        raise EOFError
    return pickle.loads(blob)


def spawn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def main() -> None:
    from radixlm.runtime.constrained.backend import GrammarError
    from radixlm.runtime.ipc import die_with_parent

    die_with_parent("radixlm-grammar")
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the reply stream
    try:
        builder = read_message(stdin)
        write_message(stdout, ("ready", None))
        while True:
            key = read_message(stdin)
            try:
                reply = ("ok", builder.build(key))
            except (GrammarError, MemoryError) as e:
                reply = ("error", str(e) or "out of memory")
            write_message(stdout, reply)
    except (EOFError, BrokenPipeError):
        return


if __name__ == "__main__":
    main()
