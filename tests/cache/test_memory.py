"""Cache pools on transparent huge pages (selfattn.cache.memory)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from selfattn.cache import PagedCache, memory


def _vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or memory.thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages: Linux with THP 'always' or 'madvise' only",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_zeros_is_torch_zeros(dtype):
    for shape in [(3, 5), (memory.MIN_BYTES // 4 + 7, 3)]:
        x = memory.zeros(*shape, dtype=dtype)
        assert x.shape == shape and x.dtype == dtype and x.is_contiguous()
        assert not x.any()


@needs_thp
def test_a_large_paged_pool_is_marked_for_huge_pages():
    # 2 x 24 MiB of float32 pages: each store's interior huge pages are madvised
    cache = PagedCache(3 * 1024, 16, 4, 32, max_seqs=1, max_pages_per_seq=8, dtype=torch.float32)
    for store in (cache.k_store, cache.v_store):
        middle = store.data_ptr() + store.numel() * store.element_size() // 2
        assert _vma_flags(middle).get("THPeligible") == "1"


@needs_thp
def test_the_off_switch_small_tensors_and_other_devices(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *a: calls.append(a) or 0)
    memory.zeros(memory.MIN_BYTES, dtype=torch.uint8)
    assert len(calls) == 1 and calls[0][2] == memory._MADV_HUGEPAGE
    monkeypatch.setenv("SELFATTN_HUGEPAGES", "0")
    memory.zeros(memory.MIN_BYTES, dtype=torch.uint8)
    monkeypatch.delenv("SELFATTN_HUGEPAGES")
    y = memory.zeros(64, 64, dtype=torch.float32)  # small: plain torch.zeros
    z = memory.zeros(memory.MIN_BYTES, dtype=torch.uint8, device="meta")
    assert len(calls) == 1 and not y.any() and z.device.type == "meta"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous maps: Linux only")
def test_a_large_pool_holds_memory_only_where_written():
    def rss_mib() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    before = rss_mib()
    x = memory.zeros(256, 1024, 1024, dtype=torch.float32)  # 1 GiB, made at once
    assert rss_mib() - before < 64  # nothing written yet: no memory behind it
    x[7].fill_(1.0)  # 4 MiB written
    assert rss_mib() - before < 64 and x[7].eq(1).all() and not x[8].any()
    view = x[7:9]
    del x  # a view keeps the map alive
    assert float(view.sum()) == 1024 * 1024
