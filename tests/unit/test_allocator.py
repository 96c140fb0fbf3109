from __future__ import annotations

import pytest
import torch

from radixlm.runtime.cache.allocator import PageAllocator


def test_alloc_and_free_move_counts() -> None:
    alloc = PageAllocator(num_pages=10, page_size=4)
    a = alloc.alloc(3)
    b = alloc.alloc(5)
    assert a.dtype == torch.int64 and a.shape == (3,) and b.shape == (5,)
    assert alloc.num_free_pages == 2
    assert set(a.tolist()).isdisjoint(b.tolist())
    alloc.free(a)
    assert alloc.num_free_pages == 5
    alloc.check_invariants(in_use=b)


def test_alloc_beyond_capacity_takes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    held = alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free_pages == 1
    alloc.free(held)
    assert alloc.alloc(5) is None
    assert alloc.num_free_pages == 4


def test_alloc_zero_is_empty() -> None:
    alloc = PageAllocator(num_pages=2, page_size=16)
    pages = alloc.alloc(0)
    assert pages is not None and pages.numel() == 0 and pages.dtype == torch.int64
    assert alloc.num_free_pages == 2


def test_freed_pages_are_reused_and_distinct() -> None:
    alloc = PageAllocator(num_pages=8, page_size=2)
    first = alloc.alloc(8)
    alloc.free(first[:3])
    alloc.free(first[5:])
    again = alloc.alloc(6)  # needs the queued batches merged
    assert sorted(again.tolist()) == sorted(first[:3].tolist() + first[5:].tolist())
    assert alloc.num_free_pages == 0
    alloc.check_invariants(in_use=torch.cat([again, first[3:5]]))


def test_reset_frees_everything() -> None:
    alloc = PageAllocator(num_pages=6, page_size=1)
    alloc.alloc(6)
    alloc.reset()
    assert alloc.num_free_pages == 6
    assert sorted(alloc.alloc(6).tolist()) == list(range(6))


def test_check_invariants_catches_double_free() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    pages = alloc.alloc(2)
    alloc.free(pages)
    alloc.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.check_invariants()


def test_check_invariants_catches_page_both_used_and_free() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    pages = alloc.alloc(2)
    with pytest.raises(AssertionError, match="both in use and free"):
        alloc.check_invariants(in_use=torch.tensor([int(pages[0]), 3]))
