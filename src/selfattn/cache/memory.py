"""Memory for large caches: page pools that cost nothing until used, on transparent huge pages
where Linux offers them.

A large pool on a Linux CPU is an anonymous memory map of its own: the kernel hands out zeroed
pages on first write, so a pool of any size is made at once (no start-up time spent zeroing it)
and holds memory only where a cache page was written (the process's RSS grows with the tokens
cached, not with the pool's size).

A paged decode reads cache pages at random places in a pool of hundreds of MiB. On 4 KiB memory
pages each 32 KiB cache page (16 slots x 8 kv heads x 128 dims in bf16) spans 8 TLB entries, and
a 512 MiB pool is 32 times what a current x86 core's second-level TLB maps: nearly every
page the kernel reads starts with a page walk. On 2 MiB pages the pool needs 256 entries. Linux
backs memory with huge pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` says
``always``, or says ``madvise`` (the common default) and the range was marked with
``madvise(MADV_HUGEPAGE)`` before its first touch, which :func:`zeros` does.

BENCHMARKS.md has the decode kernel's time on these pools against the same pages on 4 KiB pages.

``SELFATTN_HUGEPAGES=0`` turns the huge pages off (the map stays). Small tensors, other devices
and other systems get plain ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
from pathlib import Path

import torch

from selfattn._log import log_once

__all__ = ["HUGE_PAGE", "MIN_BYTES", "memory_available_bytes", "zeros"]

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
# Below this a pool gains too little to mark (at most two partial huge pages are lost at its ends).
MIN_BYTES = 8 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux, every architecture
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``""``
    where the system has none."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


@functools.cache
def _madvise():
    # The process's own C library (already loaded): nothing is looked up on a search path.
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _mapped(n_bytes: int, device: torch.device) -> bool:
    """Whether a pool of ``n_bytes`` on ``device`` is an anonymous map of its own."""
    return device.type == "cpu" and n_bytes >= MIN_BYTES and sys.platform.startswith("linux")


def _huge_pages() -> bool:
    return os.environ.get("SELFATTN_HUGEPAGES", "1") != "0" and thp_mode() in ("always", "madvise")


def zeros(*shape: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype, device=device)``; on Linux CPUs a large one is an
    anonymous memory map, zero and unbacked until written, marked for transparent huge pages
    (see the module docstring)."""
    device = torch.device("cpu" if device is None else device)
    n_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not _mapped(n_bytes, device):
        return torch.zeros(*shape, dtype=dtype, device=device)
    # private (a shared anonymous map is shmem, which gets no huge pages and is shared with a
    # forked child); the slack aligns the start to a huge page
    buf = mmap.mmap(-1, n_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the map alive as long as any view
    offset = -base.data_ptr() % HUGE_PAGE
    x = base[offset : offset + n_bytes].view(dtype).view(shape)
    if _huge_pages() and _madvise()(x.data_ptr(), n_bytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE):
        log_once(
            "madvise-hugepage",
            logging.INFO,
            "selfattn: madvise(MADV_HUGEPAGE) failed (%s); the cache pool stays on base pages",
            os.strerror(ctypes.get_errno()),
        )
    return x


def memory_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (what can be allocated without swapping), or None
    where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
