"""Building and loading the native library (kernels/cpu/build.py): its cache key, a missing
compiler, what a build killed part-way leaves, a damaged library, two processes on an empty cache.

A real build takes a minute, so most tests run build.py and torch's extension tooling for real
(torch's lock file, its loading of what it built) with only the compiler's work replaced: the
`compiler` fixture writes a stand-in library (an empty one, compiled here once) where the link
would, also in the two processes that start at once on an empty cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from radixlm.kernels.cpu import build


def _library() -> Path:
    """Where the cache keeps this machine's build (the stand-in's cache: RADIXLM_CACHE_DIR)."""
    key = build.build_key()
    return build.cache_root() / key / f"radixlm_cpu_{key}.so"


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("standin") / "standin.so"
    subprocess.run([build.compiler(), "-shared", "-fPIC", "-x", "c++", "/dev/null", "-o", str(path)], check=True)
    return path.read_bytes()


class Compiler:
    """torch's compile-and-link step, replaced: writes the stand-in library where the link would
    (first half, then whole, as a linker writes its output), counting the builds and noting
    whether the library's place in the cache held a file while one ran. `keep`: the bytes of it
    written (a truncated library), all where None."""

    def __init__(self, standin: bytes) -> None:
        self.standin = standin
        self.keep: int | None = None
        self.builds = 0
        self.seen_while_linking = False

    def __call__(self, name: str, build_directory: str, **_) -> None:
        self.builds += 1
        out = Path(build_directory) / f"{name}.so"
        out.write_bytes(self.standin[: len(self.standin) // 2])
        self.seen_while_linking |= _library().exists()
        out.write_bytes(self.standin[: self.keep])


@pytest.fixture
def compiler(standin, tmp_path, monkeypatch) -> Compiler:
    """An empty cache, this process not yet loaded from it, and the stand-in compiler."""
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", None)
    fake = Compiler(standin)
    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", fake)
    return fake


def test_a_build_appears_in_the_cache_whole_and_only_once(compiler, monkeypatch):
    """Built in a folder of its own and renamed into place: a process that looks while the build
    links finds no file (before, it found the half-written one and failed to load it)."""
    library = _library()
    assert build.load() == str(library)
    assert library.read_bytes() == compiler.standin
    assert compiler.builds == 1 and not compiler.seen_while_linking
    assert not list(library.parent.glob("build-*"))  # the build's folder removed
    monkeypatch.setattr(build, "_loaded", None)  # a later start: loaded from the cache, not built
    assert build.load() == str(library) and compiler.builds == 1


def test_what_a_killed_build_left_is_cleared(compiler):
    """A build killed part-way (Ctrl-C, a start timeout, the OOM killer) leaves torch's lock file,
    on which torch's tooling waits forever, and its objects; its fcntl lock went with it. The next
    start builds (the leftovers are stale: it holds the lock they were made under) and removes
    them. Before, every later start waited on the lock file, silently."""
    folder = _library().parent
    left = folder / "build-killed"
    left.mkdir(parents=True)
    for name in ("lock", "ops.o", "build.ninja"):
        (left / name).write_text("")
    (folder / "lock").write_text("")  # torch's lock where a build ran in the cache's folder itself
    (folder / "build.lock").write_text("999999999\n")  # the killed process's pid
    result: list = []
    start = threading.Thread(target=lambda: result.append(build.load()), daemon=True)
    start.start()
    start.join(timeout=120)  # a hang guard only: the stand-in build takes milliseconds
    assert result == [str(_library())], "the start waited on the killed build's lock"
    assert compiler.builds == 1 and not left.exists()


def test_a_library_that_does_not_load_is_built_again(compiler):
    """A truncated library in the cache (a disk that filled, a copy cut short) is rebuilt once
    and loaded; before, torch's OSError ended the start."""
    library = _library()
    library.parent.mkdir(parents=True)
    library.write_bytes(compiler.standin[:100])
    assert build.load() == str(library)
    assert compiler.builds == 1 and library.read_bytes() == compiler.standin


def test_a_library_that_does_not_load_rebuilt_is_a_clear_error(compiler):
    """Rebuilt once, still not loading (here: the build writes a truncated file): NativeBuildError
    naming it, after one build; the new file never reaches the library's place."""
    library = _library()
    library.parent.mkdir(parents=True)
    library.write_bytes(compiler.standin[:100])
    compiler.keep = 100
    with pytest.raises(build.NativeBuildError, match="building the native CPU kernels failed: .*radixlm_cpu_"):
        build.load()
    assert compiler.builds == 1 and library.read_bytes() == compiler.standin[:100]  # the old file, not a new one


def test_the_key_names_sources_cpu_and_toolchain(monkeypatch, tmp_path):
    """A home shared by two hosts: another CPU kind, compiler, C library or architecture is
    another build."""
    key = build.build_key()
    assert build.load() == str(build.cache_root() / key / f"radixlm_cpu_{key}.so")
    with monkeypatch.context() as m:
        m.setattr(build, "cpu_flags", lambda: ["avx2", "avx512f"])
        assert build.build_key() != key
    with monkeypatch.context() as m:
        m.setattr("platform.machine", lambda: "aarch64")
        assert build.build_key() != key
    with monkeypatch.context() as m:
        m.setattr("platform.libc_ver", lambda: ("musl", "1.2"))
        assert build.build_key() != key
    other = tmp_path / "c++"
    other.write_text("#!/bin/sh\necho 'c++ (Other) 99.1'\n")
    other.chmod(0o755)
    monkeypatch.setenv("CXX", str(other))
    assert build.build_key() != key


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(build.NativeBuildError, match="no-such-c\\+\\+.*--quantization none"):
        build._build(tmp_path / "radixlm_cpu_test.so")


def test_the_portable_path_builds_for_64_bit_arm(tmp_path):
    """Off x86 the vector files compile to nothing and the portable path is the library: every
    source compiled for aarch64 Linux by Debian's cross compiler (scripts/setup.sh installs it)
    against torch's headers, linked into one library that lacks nothing of its own (what it
    needs from outside is torch's, the C++ runtime's and OpenMP's, which the target has)."""
    cross = shutil.which("aarch64-linux-gnu-g++")
    assert cross, "this test needs Debian's g++-aarch64-linux-gnu (scripts/setup.sh installs it)"
    flags = [f for f in build.CFLAGS if f != "-O3"] + ["-O0", "-std=c++17", "-fPIC"]  # -O0: the test's time
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    sources = sorted(build.SOURCES.glob("*.cpp"))

    def compile_one(source: Path) -> subprocess.CompletedProcess:
        return subprocess.run([cross, *flags, "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")],
                              capture_output=True, text=True)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for source, done in zip(sources, pool.map(compile_one, sources)):
            assert done.returncode == 0, (source.name, done.stderr[-3000:])
    library = tmp_path / "radixlm_cpu.so"
    subprocess.run([cross, "-shared", "-fopenmp", "-o", str(library), *map(str, tmp_path.glob("*.o"))], check=True)
    assert int.from_bytes(library.read_bytes()[18:20], "little") == 183  # ELF e_machine: EM_AARCH64
    needed = subprocess.run(["aarch64-linux-gnu-nm", "-uC", str(library)], capture_output=True, text=True, check=True)
    assert "radixlm::" not in needed.stdout, [line for line in needed.stdout.splitlines() if "radixlm::" in line]


START = """
import logging, sys, time
from pathlib import Path
from torch.utils import cpp_extension
from radixlm.kernels import cpu

def link(name, build_directory, **_):  # the compiler's work replaced, slow enough that the two overlap
    out = Path(build_directory) / f"{name}.so"
    out.write_bytes(b"")
    time.sleep(1)
    out.write_bytes(Path(sys.argv[1]).read_bytes())

cpp_extension._write_ninja_file_and_build_library = link
logging.basicConfig(level=logging.INFO)
print(cpu.load())
"""


def test_two_processes_starting_at_once_on_an_empty_cache_build_once(tmp_path, standin):
    """Two starts on an empty cache (the scheduler and a tensor-parallel rank, two servers): one
    builds, the other waits on its lock and then loads the same file. Processes of their own (the
    test process has its library loaded), each with the stand-in compiler; the real build is the
    one every other test's first load makes."""
    (tmp_path / "standin.so").write_bytes(standin)
    env = {**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path)}
    starts = [subprocess.Popen([sys.executable, "-c", START, str(tmp_path / "standin.so")], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in starts]
    for p, (out, err) in zip(starts, outs):
        assert p.returncode == 0, err
    paths = {out.split()[0] for out, _ in outs}
    assert len(paths) == 1 and Path(paths.pop()).read_bytes() == standin
    assert sum(err.count("building the native CPU kernels into") for _, err in outs) == 1
    assert not list(tmp_path.glob("kernels/*/build-*"))
