"""Host-side allocator over the KV-cache pages, with prefix caching.

Pages are the unit of allocation, sharing and preemption. Each page has a reference count; a page
with count 0 is either free (on the free list) or *cached*: it is full, its tokens are known by a
chained hash, and a later request with the same prefix can take it back. Cached pages nobody holds
are evicted least-recently-used first when the free list runs dry; with a host tier
(``core/host_tier.py``) an evicted page is first copied to host memory, and a prefix found there
is loaded back into fresh pages instead of being computed again.

The chained hash of page ``i`` covers all tokens of pages ``0..i`` (``hash((parent_hash, tokens))``),
so equal hashes mean equal prefixes, not just equal pages. The hash is a 128-bit BLAKE2b digest:
a collision would hand one request another's KV, so Python's 64-bit ``hash`` is not enough.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from myserve.core.host_tier import HostTier

PageHash = bytes

_ROOT_HASH: PageHash = b"myserve-prefix-root"


def chain_hashes(token_ids: Sequence[int], page_size: int, parent: PageHash = _ROOT_HASH) -> list[PageHash]:
    """Chained hashes of every *full* page of ``token_ids``, starting after ``parent``."""
    hashes = []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = hashlib.blake2b(parent + tokens[start : start + page_size].tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class OutOfPages(Exception):
    """Raised by ``allocate`` when neither free nor evictable pages remain."""


class PageAllocator:
    """Free list, reference counts and the prefix cache of ``num_pages`` pages of ``page_size`` tokens."""

    def __init__(
        self, num_pages: int, page_size: int, *, enable_prefix_cache: bool = True, host: HostTier | None = None
    ):
        """``host``: the host-memory tier evicted cached pages go to (None: they are forgotten)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._refs = [0] * num_pages
        self._page_hash: dict[int, PageHash] = {}  # cached page -> its chained hash
        self._by_hash: dict[PageHash, int] = {}  # chained hash -> cached page
        # Cached pages with refcount 0, oldest use first: the eviction order.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from cached pages
        self.host = host if enable_prefix_cache else None
        self._saves: list[tuple[int, int]] = []  # (device page, host slot) copies the next step must precede
        self._loads: list[tuple[int, int]] = []  # (host slot, device page) fills, after the saves

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages available to ``allocate`` right now (free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.num_free

    def refcount(self, page: int) -> int:
        """References held on ``page``."""
        return self._refs[page]

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` pages can be allocated now."""
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (refcount 1 each), evicting LRU cached pages if the free list is short."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                page_hash = self._page_hash.pop(page)
                del self._by_hash[page_hash]
                slot = None if self.host is None else self.host.store(page_hash)
                if slot is not None:  # copied out before the step that reuses the page writes it
                    self._saves.append((page, slot))
            self._refs[page] = 1
            pages.append(page)
        return pages

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``/reset_prefix_cache``): unreferenced cached pages return to
        the free list, and pages in use are no longer offered to later requests (they stay their
        sequences'). Returns how many pages were forgotten."""
        forgotten = len(self._page_hash) + (self.host.clear() if self.host is not None else 0)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_hash.clear()
        self._by_hash.clear()
        return forgotten

    def share(self, pages: Sequence[int]) -> None:
        """Add a reference to each page (another sequence now reads them: n > 1, prefix hits)."""
        for page in pages:
            if self._refs[page] == 0:
                self._evictable.pop(page, None)
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages become free, or evictable if cached."""
        for page in pages:
            refs = self._refs[page] - 1
            if refs < 0:
                raise ValueError(f"page {page} released more often than referenced")
            self._refs[page] = refs
            if refs == 0:
                if page in self._page_hash:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[PageHash], num_prompt_tokens: int) -> list[int]:
        """Cached pages for the longest cached run of ``hashes``; each gains a reference.

        At most ``(num_prompt_tokens - 1) // page_size`` pages are taken, so the last prompt
        token is always computed (its logits start generation).
        """
        limit = (num_prompt_tokens - 1) // self.page_size
        if not self.enable_prefix_cache:
            return []
        pages = []
        for h in hashes[:limit]:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        self.share(pages)  # also takes them out of the eviction order
        return pages

    def match_host(self, hashes: Sequence[PageHash], start: int, num_prompt_tokens: int) -> list[int]:
        """Host slots of the run of ``hashes[start:]`` (after the device's ``start`` hits) the host
        tier holds, within ``match_prefix``'s limit; pinned until the transfers are taken, or
        ``unpin_host``."""
        if self.host is None:
            return []
        return self.host.match(hashes[start : max(start, (num_prompt_tokens - 1) // self.page_size)])

    def unpin_host(self, slots: Sequence[int]) -> None:
        """Matched host slots not loaded after all (the sequence did not fit)."""
        if self.host is not None:
            self.host.unpin(slots)

    def load(self, slots: Sequence[int], pages: Sequence[int], hashes: Sequence[PageHash]) -> None:
        """Fill freshly allocated ``pages`` from host ``slots`` before the next step; they are then
        cached under ``hashes`` like computed pages. The slots stay pinned until the transfers are
        taken, so that no save of the same step lands in a slot before it is read."""
        self._loads.extend(zip(slots, pages, strict=True))
        for page, page_hash in zip(pages, hashes, strict=True):
            self.cache_page(page, page_hash)

    @property
    def transfers_owed(self) -> int:
        """Host-tier saves and loads recorded and not yet taken by a step (0 when idle)."""
        return len(self._saves) + len(self._loads)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies the next step must be preceded by, in order: (device page, host
        slot) saves, then (host slot, device page) loads."""
        saves, loads = self._saves, self._loads
        self._saves, self._loads = [], []
        self.unpin_host([slot for slot, _ in loads])
        return saves, loads

    def record_lookup(self, num_tokens: int, hit_tokens: int, host_tokens: int = 0) -> None:
        """Count one admitted sequence's prefix lookup for the hit rate (``hit_tokens`` from the
        device's pages, ``host_tokens`` more from the host tier's)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += hit_tokens
        if self.host is not None:
            self.host.hit_tokens += host_tokens

    def cache_page(self, page: int, page_hash: PageHash) -> None:
        """Record that ``page`` is full with the tokens ``page_hash`` stands for.

        If another page already caches that prefix (two requests computed it at once), this page
        stays uncached and returns to the free list when released.
        """
        if not self.enable_prefix_cache or page in self._page_hash or page_hash in self._by_hash:
            return
        self._page_hash[page] = page_hash
        self._by_hash[page_hash] = page
