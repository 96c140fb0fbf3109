"""Page allocator for the KV pool: hands out page ids, takes them back."""
from __future__ import annotations

import torch


class PageAllocator:
    """Hands out fixed-size pages of KV slots. Slot s lives in page s // page_size.

    Free pages are kept as int64 tensors on `device`: one ready tensor plus a list
    of returned batches that is concatenated only when an alloc needs it, so both
    alloc and free cost O(n) tensor work and no per-page Python.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu") -> None:
        assert num_pages > 0 and page_size > 0, (num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget every allocation: all pages are free again."""
        self._ready = torch.arange(self.num_pages, dtype=torch.int64, device=self.device)
        self._returned: list[torch.Tensor] = []
        self._num_returned = 0

    @property
    def num_free_pages(self) -> int:
        return self._ready.numel() + self._num_returned

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` pages (1-D int64 ids), or None, taking nothing, when fewer are free."""
        assert n >= 0, n
        if n > self.num_free_pages:
            return None
        if n > self._ready.numel():
            self._merge_returned()
        pages, self._ready = self._ready[:n], self._ready[n:]
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Give pages back. Cheap: the batch is only queued until an alloc needs it."""
        if pages.numel():
            self._returned.append(pages.reshape(-1).to(self.device, torch.int64))
            self._num_returned += pages.numel()

    def _merge_returned(self) -> None:
        self._ready = torch.cat([self._ready, *self._returned])
        self._returned.clear()
        self._num_returned = 0

    def check_invariants(self, in_use: torch.Tensor | None = None) -> None:
        """Debug/tests only (O(pool)): free ids are distinct, in range, disjoint from `in_use`."""
        free = torch.cat([self._ready, *self._returned])
        assert free.numel() == self.num_free_pages, "free count drifted from the free list"
        assert free.numel() == free.unique().numel(), "a page was freed twice"
        assert free.numel() == 0 or (free.min() >= 0 and free.max() < self.num_pages), "page id out of range"
        if in_use is not None and in_use.numel():
            in_use = in_use.to(self.device)
            clash = in_use[torch.isin(in_use, free)]
            assert clash.numel() == 0, f"pages both in use and free: {clash.tolist()[:8]}"
