"""Building the native library on the machine that runs it, once, and loading it.

The C++ sources in `csrc/` are compiled with torch's extension tooling (ninja and the machine's
C++ compiler) into `$RADIXLM_CACHE_DIR/kernels/<key>/` (default `~/.cache/radixlm`), where the
key hashes the sources, the build flags, torch's version and the CPU's flags. A second process
that wants the same build waits on a file lock and then loads what the first built; a later
start finds the library and loads it without running the build tools at all.

The library is built for a generic x86-64 target; its AVX2 functions carry their own target
attributes, and `ops.cpp` picks the best path the CPU runs at run time (cpuid), so one build
also serves a machine of another kind that reads the same cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
# -ffp-contract=off: no multiply-add fused unless the code says so, so that the portable path and
# the vector paths round alike (tests compare them bitwise).
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_int8", "amx_bf16")

_loaded: str | None = None


class NativeBuildError(RuntimeError):
    """The native library could not be built or loaded here; the message says what is missing."""


def cpu_flags() -> list[str]:
    """The CPU features the library's dispatch looks at, from /proc/cpuinfo (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.partition(":")[2].split())
                    return [f for f in _CPU_FLAGS if f in have]
    except OSError:
        pass
    return []


def build_key() -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS + cpu_flags()).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")
    return Path(root) / "kernels"


def load() -> str:
    """Build the library if this machine has no build of these sources yet, load it into the
    process (once), and return the path of the loaded file. Raises NativeBuildError."""
    global _loaded
    if _loaded is not None:
        return _loaded
    import torch

    key = build_key()
    folder = cache_root() / key
    name = f"radixlm_cpu_{key}"
    library = folder / f"{name}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then find the file
            if not library.exists():
                _build(name, folder)
    torch.ops.load_library(str(library))
    _loaded = str(library)
    return _loaded


def _build(name: str, folder: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"the native CPU kernels need a C++ compiler ({compiler!r} is not on PATH): install g++ "
                               "(Debian: apt-get install g++), or serve with --quantization none")
    if shutil.which("ninja") is None:
        raise NativeBuildError("the native CPU kernels are built with ninja, which is not on PATH: pip install ninja, "
                               "or serve with --quantization none")
    start = time.perf_counter()
    log.info("building the native CPU kernels into %s (once per machine and source version)", folder)
    try:
        # copies: torch's tooling appends its own flags to the lists it is given
        cpp_extension.load(name=name, sources=sorted(str(p) for p in SOURCES.glob("*.cpp")), extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS), build_directory=str(folder), is_python_module=False,
                           verbose=False)
    except Exception as e:  # the compiler's own output is in the exception's text
        raise NativeBuildError(f"building the native CPU kernels failed: {e}") from e
    log.info("native CPU kernels built in %.0f s", time.perf_counter() - start)
