"""Building and loading the C kernels: each library's build spec is data, its cache is trusted.

A C kernel library is a :class:`CLibrary`: its source files (under ``kernels/csrc/``, shipped in
the wheel), the compiler flags, the target flags tried in order (``-march=native`` first, then
portable code for compilers or CPUs that reject it), the system libraries it links and the
functions it exports with their :mod:`ctypes` signatures. :func:`load` returns it as a
:class:`ctypes.CDLL` with every function declared, compiling it first where the cache lacks it;
None where it cannot be built (no compiler, a failed build) or lacks one of its functions.

Build: plain C (no PyTorch headers), with the system C compiler (``$CC``, else ``cc``, ``gcc``,
``clang``), on first use, into ``$SELFATTN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/selfattn``, else
``~/.cache/selfattn``), under a name hashing everything that shapes the machine code (sources,
compiler, flags, and the CPU's feature flags: ``-march=native`` code must not load on another
CPU). Builders of one cache (processes, or threads of one process) take turns on an exclusive
``flock`` of the cache directory itself, so one compiles and the others find its library; each
build is written in a private temporary directory and renamed into place, so a loader sees all of
it or nothing. No ahead-of-time build: a wheel ships the sources, and the first call builds.

Trust: the cache holds code this process runs, so its directory is created 0700, and a cache
dir or library that another user owns or could write (group/world-writable, or under a
directory others may rename entries in; symlinks are followed and their targets checked) is
never loaded: the library is then built in a private temporary directory for this process, and
the ``selfattn`` logger says why, once. A loaded library lacking one of its functions is logged
and not used.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CLibrary", "Function", "build_errors", "cache_dir", "compile_library", "compiler", "load",
    "loader",
    "openmp_flags",
]  # fmt: skip

CSRC = Path(__file__).resolve().parent / "csrc"
# The cache holds code this process runs: its directories are created owner-only.
_PRIVATE_DIR = 0o700
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
# A header of ours, included by a source: its text goes into the library's hash.
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# A build of one of our kernels takes seconds on a busy 2-core machine; a compiler still running
# after this long is stuck.
COMPILE_TIMEOUT_S = 120
# A builder waits for another's lock at most as long as that one's build may take, plus slack;
# past it (the holder stopped, or hung on a network file system) it builds anyway: the atomic
# rename keeps the cache correct, at the price of a second compile.
LOCK_WAIT_S = COMPILE_TIMEOUT_S + 30
_LOCK_POLL_S = 0.05

log = logging.getLogger("selfattn")


@dataclass(frozen=True)
class Function:
    """A function the library exports, with its :mod:`ctypes` signature."""

    name: str
    argtypes: tuple = ()
    restype: Any = ctypes.c_int


@dataclass(frozen=True)
class CLibrary:
    """The build spec of one C kernel library (see the module docstring)."""

    name: str  # file name stem of the built library
    sources: tuple[str, ...]  # paths under kernels/csrc/
    functions: tuple[Function, ...]  # a library lacking one of them is not used
    flags: tuple[str, ...] = ("-O3", "-fPIC", "-shared")
    # Target flags, tried in order until one builds: e.g. -march=native, then portable code.
    targets: tuple[tuple[str, ...], ...] = ((),)
    libraries: tuple[str, ...] = ()  # linked as -l<name>, after the sources
    # Built with -fopenmp where PyTorch's OpenMP runtime is one a C build can share (see
    # openmp_flags), each target first with it, then without.
    openmp: bool = False

    def source_paths(self) -> list[Path]:
        return [CSRC / s for s in self.sources]

    def input_paths(self) -> list[Path]:
        """Every file of ``kernels/csrc/`` the build reads: the sources and the headers they
        include by quotes (``#include "thread_pool.h"``), transitively, each once."""
        seen: list[Path] = []
        todo = self.source_paths()
        while todo:
            path = todo.pop(0)
            if path not in seen:
                seen.append(path)
                todo += [path.parent / name for name in _LOCAL_INCLUDE.findall(path.read_text())]
        return seen

    def target_flags(self, cc: str) -> list[tuple[str, ...]]:
        """The target flags to try with compiler ``cc``, in order: with OpenMP first where it
        can be shared."""
        extra = openmp_flags(cc) if self.openmp else ()
        return [*(t + extra for t in self.targets if extra), *self.targets]


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path:
    """Where built libraries are kept (not yet created, resolved or checked)."""
    root = os.environ.get("SELFATTN_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "selfattn"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: a library built on one CPU must not load on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` spells them (``avx512_bf16``,
    ``amx_bf16``, ...); empty where there is no such file."""
    line = _cpu_id()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def _mapped_libgomps() -> list[Path]:
    """The GNU libgomp files this process has loaded (/proc/self/maps), each once."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return []
    return sorted(Path(p) for p in paths)


def _shareable_libgomp(torch_dir: Path) -> bool:
    """Whether a build's ``-fopenmp`` (NEEDED libgomp.so.1) binds to PyTorch's copy: one named
    by that soname is loaded (PyTorch's CPU wheels ship ``torch/lib/libgomp.so.1``), and PyTorch
    ships none under another name (wheels repaired by auditwheel carry ``libgomp-<hash>.so.1``,
    a soname a build cannot bind to: its libgomp.so.1 would be a second runtime)."""
    loaded = _mapped_libgomps()
    mine = [p for p in loaded if p.is_relative_to(torch_dir)]
    if any(not p.name.startswith("libgomp.so.1") for p in mine):
        return False
    return any(p.name.startswith("libgomp.so.1") for p in (mine or loaded))


@functools.cache
def _is_gcc(cc: str) -> bool:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return b"Free Software Foundation" in out.stdout and b"clang" not in out.stdout


def openmp_flags(cc: str) -> tuple[str, ...]:
    """``("-fopenmp",)`` where a kernel built by ``cc`` with it shares PyTorch's OpenMP threads
    (see ``csrc/thread_pool.h`` for why that matters): Linux, GCC (whose -fopenmp links GNU
    libgomp), PyTorch's parallel backend OpenMP on libgomp (loaded in this process: the soname
    libgomp.so.1 then binds the build's libgomp to that copy), and ``SELFATTN_KERNEL_OPENMP``
    not ``0``. Else ``()``: the kernels start threads of their own (a second runtime, e.g.
    clang's libomp beside PyTorch's libgomp, would be two pools fighting for the cores)."""
    if os.environ.get("SELFATTN_KERNEL_OPENMP", "1") == "0" or platform.system() != "Linux":
        return ()
    return ("-fopenmp",) if _torch_on_libgomp() and _is_gcc(cc) else ()


@functools.cache
def _torch_on_libgomp() -> bool:
    import torch  # the kernels run on PyTorch tensors; imported here to ask its build

    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    return _shareable_libgomp(Path(torch.__file__).resolve().parent)


def library_name(spec: CLibrary, cc: str, flags: list[str]) -> str:
    """The cached library's file name: a hash of everything that shapes the machine code (the
    sources and the headers they include, the compiler, the flags, the CPU)."""
    sources = [p.read_text() for p in spec.input_paths()]
    key = hashlib.sha256("\0".join([*sources, cc, *flags, _cpu_id()]).encode()).hexdigest()
    return f"{spec.name}_{key[:16]}.so"


def _distrust(path: Path, *, parent: bool = False) -> str | None:
    """Why this process must not run code from ``path`` (or from below it), or None.

    The cache holds code we execute, so whoever can write, replace or rename it can run code as
    us. The cache dir and the library must be ours and writable by no one else (the library a
    regular file, not a symbolic link to one elsewhere); each directory above them must be ours
    or root's, and writable by others only with the sticky bit (``/tmp``), which stops them
    renaming our entries. Ownership is not checked where the OS has no uids.
    """
    st = os.stat(path) if parent else os.lstat(path)
    uid = os.getuid() if hasattr(os, "getuid") else None
    owners = (0, uid) if parent else (uid,)
    if uid is not None and st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if not parent and stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_mode & _WRITABLE_BY_OTHERS and not (parent and st.st_mode & stat.S_ISVTX):
        sticky = " without the sticky bit" if parent else ""
        return f"{path} is group- or world-writable{sticky} (mode {stat.filemode(st.st_mode)})"
    return None


def _trusted_cache_dir() -> Path | None:
    """The cache dir, created owner-only (0700) where missing and resolved through symlinks, or
    None when it cannot be made or trusted (the reason logged once): build privately then."""
    try:
        path = cache_dir()
        for d in reversed([d for d in (path, *path.parents) if not d.exists()]):
            d.mkdir(mode=_PRIVATE_DIR, exist_ok=True)
        real = Path(os.path.realpath(path))  # check, and later use, what the links point to
        why = _distrust(real) or next(
            filter(None, (_distrust(d, parent=True) for d in real.parents)), None
        )
    except (OSError, RuntimeError) as e:  # RuntimeError: Path.home() without a home
        why = f"it cannot be created ({e})"
    if why is None:
        return real
    log.warning(
        "selfattn kernels: not using the cache dir: %s; building in a private temporary "
        "directory instead (chmod 700 the cache dir if it is yours, or point SELFATTN_CACHE_DIR "
        "at a directory only you can write)",
        why,
    )
    return None


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` itself (no lock file to leave behind or to
    plant) while building into it. Where the OS or file system has no ``flock``, or another
    builder holds it past :data:`LOCK_WAIT_S` (logged), build without it."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning(
                        "selfattn kernels: another build has held %s for over %d s; building "
                        "without waiting for it",
                        directory,
                        LOCK_WAIT_S,
                    )
                    break
                time.sleep(_LOCK_POLL_S)
            except OSError:  # a file system without flock
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def compile_library(spec: CLibrary, cc: str, flags: list[str], out_dir: Path, name: str) -> Path:
    """Compile ``spec`` into ``out_dir / name`` atomically: built in a private temporary dir
    beside it, then renamed, so a concurrent builder or loader sees all or nothing."""
    path = out_dir / name
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # mode 0700
        out = Path(tmp) / name
        sources = [str(p) for p in spec.source_paths()]
        libs = [f"-l{lib}" for lib in spec.libraries]
        subprocess.run(
            [cc, *flags, *sources, "-o", str(out), *libs],
            check=True,
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        out.chmod(0o700)  # whatever the umask: the next load refuses a group-writable library
        os.replace(out, path)
    return path


def _bind(spec: CLibrary, path: Path) -> ctypes.CDLL | None:
    """Load the library and declare its functions; None (logged) when one is missing."""
    lib = ctypes.CDLL(str(path))
    missing = [f.name for f in spec.functions if not hasattr(lib, f.name)]
    if missing:
        log.warning(
            "selfattn %s kernel: %s lacks %s; the kernel is not used (delete the file to "
            "rebuild it)",
            spec.name,
            path,
            ", ".join(missing),
        )
        return None
    for f in spec.functions:
        fn = getattr(lib, f.name)
        fn.argtypes, fn.restype = list(f.argtypes), f.restype
    return lib


def load(spec: CLibrary) -> ctypes.CDLL | None:
    """The library of ``spec``: loaded from the cache, built there first where missing; None
    where it cannot be built or loaded (the caller then runs its PyTorch path).

    A cache dir or library this process must not trust (:func:`_distrust`) is never loaded:
    the library is then built in a private temporary directory, for this process only.
    """
    cc = compiler()
    if cc is None:
        log.warning(
            "selfattn %s kernel: no C compiler found ($CC, cc, gcc, clang); the PyTorch path "
            "runs instead (install one, e.g. apt-get install gcc, for the faster kernel)",
            spec.name,
        )
        return None
    cache = _trusted_cache_dir()
    failures = []
    for target in spec.target_flags(cc):
        flags = [*spec.flags, *target]
        try:
            name = library_name(spec, cc, flags)
            if cache is not None:
                path = cache / name
                if not os.path.lexists(path):
                    with _build_lock(cache):
                        if not os.path.lexists(path):  # not built while we waited
                            compile_library(spec, cc, flags, cache, name)
                why = _distrust(path)
                if why is None:
                    return _bind(spec, path)
                log.warning(
                    "selfattn %s kernel: refusing the cached library: %s; building in a "
                    "private temporary directory instead",
                    spec.name,
                    why,
                )
            with tempfile.TemporaryDirectory(prefix="selfattn-") as tmp:  # mode 0700
                return _bind(spec, compile_library(spec, cc, flags, Path(tmp), name))
        except (OSError, subprocess.SubprocessError) as e:
            failures.append(_build_failure(flags, e))
            continue
    log.warning(
        "selfattn %s kernel: could not be built with %s; the PyTorch path runs instead. %s",
        spec.name,
        cc,
        " | ".join(failures),
    )
    return None


def build_errors(spec: CLibrary) -> list[str]:
    """Why ``spec`` does not build and load with this machine's compiler: one entry per target
    that failed (its command line and the compiler's whole stderr, or the functions the library
    lacks); empty where a target builds and loads, or where there is no compiler.

    Builds afresh in a private temporary directory, the cache neither read nor written: the
    full account behind :func:`load`'s one-line warning, for tests and diagnostics."""
    cc = compiler()
    errors: list[str] = []
    for target in spec.target_flags(cc) if cc else ():
        flags = [*spec.flags, *target]
        with tempfile.TemporaryDirectory(prefix="selfattn-") as tmp:
            try:
                path = compile_library(spec, cc, flags, Path(tmp), library_name(spec, cc, flags))
                lib = ctypes.CDLL(str(path))
            except (OSError, subprocess.SubprocessError) as e:
                stderr = getattr(e, "stderr", None)
                detail = stderr.decode(errors="replace").strip() if stderr else str(e)
                errors.append(f"{cc} {' '.join(flags)}:\n{detail}")
                continue
        missing = [f.name for f in spec.functions if not hasattr(lib, f.name)]
        if not missing:
            return []
        errors.append(f"{cc} {' '.join(flags)}: the library lacks {', '.join(missing)}")
    return errors


def _build_failure(flags: list[str], error: Exception) -> str:
    """One line on why a build with ``flags`` failed: the compiler's first error (else its last
    words), or the error."""
    stderr = getattr(error, "stderr", None)
    lines = stderr.decode(errors="replace").strip().splitlines() if stderr else []
    detail = [ln for ln in lines if "error" in ln][:1] or lines[-1:]
    return f"{' '.join(flags)}: {detail[0].strip() if detail else error}"


def loader(spec: CLibrary, env_var: str) -> Callable[[], ctypes.CDLL | None]:
    """A kernel module's ``library()``: ``spec``'s library, built and loaded on the first call
    that wants it (:func:`load`, once), or None where it cannot be or ``env_var`` is ``"0"``
    (read at every call: tests switch it)."""
    once = functools.cache(lambda: load(spec))

    def library() -> ctypes.CDLL | None:
        return None if os.environ.get(env_var, "1") == "0" else once()

    return library
