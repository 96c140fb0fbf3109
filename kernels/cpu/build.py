"""Building the native library on the machine that runs it, once, and loading it.

The C++ sources in `csrc/` are compiled with torch's extension tooling (ninja and the machine's
C++ compiler) into `$RADIXLM_CACHE_DIR/kernels/<key>/` (default `~/.cache/radixlm`), where the
key hashes the sources, the build flags, torch's version, the CPU's flags and the toolchain (the
compiler's version, the C library, the machine's architecture: a home shared by two hosts holds
a build for each). A later start finds the library and loads it without running the build tools.

One process builds at a time, under an fcntl lock on the key's folder (`build.lock`, released by
the kernel however its holder ends); the others wait on it, then load what it built. A build
runs in a folder of its own (`build-*`) and its library is renamed into place only once whole,
so a process never sees a half-linked file; what a build killed part-way left (its folder, and
in it torch's own lock file, on which torch's tooling would wait forever) is removed by the next
holder of the lock, since its owner is gone. A library that does not load (a truncated file)
is rebuilt once; one that still does not load is a `NativeBuildError`.

The library is built for a generic target; on x86 its AVX2 and AVX-512 functions carry their
own target attributes, and `ops.cpp` picks the best path the CPU runs at run time (cpuid), so one
build also serves a machine of another kind that reads the same cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def toolchain() -> str:
    """What a build's machine code depends on beyond its sources and flags: the compiler (its
    version line), the C library and the machine's architecture."""
    try:
        found = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=60)
        version = found.stdout.partition("\n")[0]
    except (OSError, subprocess.SubprocessError):
        version = "no compiler"
    return " ".join([compiler(), version, *platform.libc_ver(), platform.machine()])


def build_key() -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS + cpu_flags()).encode())
    h.update(torch.__version__.encode())
    h.update(toolchain().encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")
    return Path(root) / "kernels"


def library_path() -> Path:
    """Where this machine's build of these sources lives (whether or not it is there yet)."""
    key = build_key()
    return cache_root() / key / f"radixlm_cpu_{key}.so"


def load() -> str:
    """Build the library if this machine has no build of these sources yet, load it into the
    process (once), and return the path of the loaded file. Raises NativeBuildError."""
    global _loaded
    if _loaded is None:
        _loaded = _load(library_path())
    return _loaded


def _load(library: Path) -> str:
    import torch

    if not library.exists() and _build_locked(library, broken=None):
        return str(library)  # built here, and so loaded: torch's tooling loads what it builds
    found = _identity(library)
    try:
        torch.ops.load_library(str(library))
        return str(library)
    except OSError as e:  # a damaged file (truncated, say): rebuilt once
        log.warning("the native CPU kernels at %s do not load (%s); building them again", library, e)
    if not _build_locked(library, broken=found):
        _load_built(library)
    return str(library)


def _load_built(library: Path) -> None:
    """Load a library another process has just built again, after this one failed to load."""
    import torch

    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        raise NativeBuildError(f"the native CPU kernels at {library} do not load, also rebuilt: {e}; delete "
                               f"{library.parent} and start again, or serve with --quantization none") from e


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file is at `path` (inode, size, modification time), None where none is."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _build_locked(library: Path, broken: tuple[int, int, int] | None) -> bool:
    """Under the folder's lock: build the library unless another process has done so since this
    one looked (`broken`: the file that failed to load, which is to be replaced). Returns
    whether this process built it (and so has it loaded)."""
    folder = library.parent
    folder.mkdir(parents=True, exist_ok=True)
    with _folder_lock(folder):
        if library.exists() and _identity(library) != broken:
            return False
        _remove_stale(folder)
        _build(library)
        return True


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """The folder's build lock, held for the block (its file records the holder's pid, which a
    waiter names). fcntl's lock goes with its holder: one killed never leaves it taken."""
    with open(folder / "build.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            log.info("waiting for process %s, which is building the native CPU kernels in %s", f.read().strip() or "?",
                     folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def _remove_stale(folder: Path) -> None:
    """What builds killed part-way left in the folder (their owners are gone: this process holds
    the lock they held): their build folders, torch's lock file among them."""
    for left in folder.glob("build-*"):
        log.info("removing %s, left by a build that did not finish", left)
        shutil.rmtree(left, ignore_errors=True)


def _build(library: Path) -> None:
    """Compile the sources in a build folder of their own beside `library`, load the result, and
    rename it into place (atomic: a reader finds the whole file or none)."""
    from torch.utils import cpp_extension

    if shutil.which(compiler()) is None:
        raise NativeBuildError(f"the native CPU kernels need a C++ compiler ({compiler()!r} is not on PATH): install "
                               "g++ (Debian: apt-get install g++), or serve with --quantization none")
    if shutil.which("ninja") is None:
        raise NativeBuildError("the native CPU kernels are built with ninja, which is not on PATH: pip install ninja, "
                               "or serve with --quantization none")
    start = time.perf_counter()
    log.info("building the native CPU kernels into %s (once per machine and source version)", library.parent)
    work = tempfile.mkdtemp(prefix="build-", dir=library.parent)
    try:
        # copies: torch's tooling appends its own flags to the lists it is given. It returns the
        # file it built and loaded (its name gets a version suffix if this process built one before).
        built = cpp_extension.load(name=library.stem, sources=sorted(str(p) for p in SOURCES.glob("*.cpp")),
                                   extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=work,
                                   is_python_module=False, verbose=False)
        os.replace(built, library)
    except Exception as e:  # the compiler's own output is in the exception's text
        raise NativeBuildError(f"building the native CPU kernels failed: {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("native CPU kernels built in %.0f s", time.perf_counter() - start)
