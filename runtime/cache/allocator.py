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

    def free_duplicates(self, kept: torch.Tensor, duplicates: torch.Tensor) -> None:
        """Free `duplicates`: pages holding the same tokens as `kept`, the radix tree's copy."""
        self.free(duplicates)

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


class WindowedPageAllocator(PageAllocator):
    """Pages of a model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral with a window).

    The global layers keep every cached token; a sliding layer reads only the last `window`. So
    the sliding layers' K/V live in a second slot space: each page in use (of the global layers'
    space, the one the radix tree and the request rows hold) is bound to a page of the window
    space (`page_map`) from its allocation until the tokens in it fall out of every window that
    will still read them (`unbind`, kv_manager.KVManager.drop_windows) or the page is freed.

    The window space has as many pages as the global one, so binding never fails where the
    allocation succeeded, and it hands out its lowest free pages first: its tensors are zeroed
    lazily (kv_pool.zeroed), so they are resident only up to the most pages bound at once, not
    every page the tree holds. A long conversation holds its whole history for the global layers
    and about a window of it for the sliding ones.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        # +1: the pool's spare page (padding rows write there) maps to the window space's spare
        self.page_map = torch.full((num_pages + 1,), -1, dtype=torch.int64, device=device)
        self._window_free = torch.ones(num_pages, dtype=torch.bool, device=device)
        super().__init__(num_pages, page_size, device)

    def reset(self) -> None:
        super().reset()
        self.page_map.fill_(-1)
        self.page_map[-1] = self.num_pages
        self._window_free.fill_(True)
        self.num_bound_pages = 0

    def alloc(self, n: int) -> torch.Tensor | None:
        pages = super().alloc(n)
        if pages is not None and n:
            window = torch.nonzero(self._window_free).flatten()[:n]  # the lowest first
            self._window_free[window] = False
            self.page_map[pages] = window
            self.num_bound_pages += n
        return pages

    def free(self, pages: torch.Tensor) -> None:
        self.unbind(pages)
        super().free(pages)

    def unbind(self, pages: torch.Tensor) -> None:
        """Give back the window pages of `pages` (those still bound); the pages stay in use."""
        window = self.page_map[pages]
        window = window[window >= 0]
        if window.numel():
            self._window_free[window] = True
            self.page_map[pages] = -1
            self.num_bound_pages -= window.numel()

    def free_duplicates(self, kept: torch.Tensor, duplicates: torch.Tensor) -> None:
        """Free `duplicates`, pages holding the same tokens as `kept` (the radix tree's copy): where
        only the duplicate is still bound, its window page moves to the kept one first."""
        move = (self.page_map[kept] < 0) & (self.page_map[duplicates] >= 0)
        if bool(move.any()):
            self.page_map[kept[move]] = self.page_map[duplicates[move]]
            self.page_map[duplicates[move]] = -1
        self.free(duplicates)

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The window space's slots of `slots` (of pages bound; an unbound page's read as slot 0:
        what only masked-out keys read)."""
        P = self.page_size
        window = self.page_map[slots // P]
        return torch.where(window >= 0, window * P + slots % P, 0)

    def check_invariants(self, in_use: torch.Tensor | None = None) -> None:
        super().check_invariants(in_use)
        bound = self.page_map[:-1] >= 0
        window = self.page_map[:-1][bound]
        assert window.numel() == self.num_bound_pages, "bound page count drifted"
        assert window.numel() == window.unique().numel(), "a window page is bound twice"
        assert not bool(self._window_free[window].any()), "a bound window page is also free"
        assert int((~self._window_free).sum()) == self.num_bound_pages, "window pages in use but bound to none"
        free = torch.cat([self._ready, *self._returned])
        assert not bool(bound[free].any()), "a free page is still bound to a window page"
