"""PageAllocator and SlotPool alone: free list, reference counts, prefix cache, LRU eviction, slots.

Host bookkeeping only: no model, no device, no JAX.
"""

from __future__ import annotations

import pytest

from myserve.core.pages import OutOfPages, PageAllocator, chain_hashes
from myserve.core.slots import OutOfSlots, SlotPool


def test_allocate_release_and_refcounts() -> None:
    a = PageAllocator(4, 2)
    pages = a.allocate(3)
    assert sorted(pages) == [0, 1, 2] and a.num_free == 1 and a.num_used == 3
    a.share(pages[:2])
    assert [a.refcount(p) for p in pages] == [2, 2, 1]
    a.release(pages)
    assert [a.refcount(p) for p in pages] == [1, 1, 0] and a.num_free == 2
    a.release(pages[:2])
    assert a.num_free == 4 and a.num_used == 0
    with pytest.raises(ValueError):
        a.release([pages[0]])  # one release too many is a bug, not a no-op
    with pytest.raises(OutOfPages):
        a.allocate(5)


def test_chain_hashes_cover_the_whole_prefix() -> None:
    a = chain_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # full pages only
    b = chain_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same second page, different first page: different chained hash
    assert chain_hashes([1, 2, 3, 4], 2) == a


def test_prefix_hit_takes_cached_pages_and_keeps_the_last_token_to_compute() -> None:
    a = PageAllocator(8, 2)
    tokens = [5, 6, 7, 8, 9, 10]
    hashes = chain_hashes(tokens, 2)
    pages = a.allocate(3)
    for page, h in zip(pages, hashes, strict=True):
        a.cache_page(page, h)
    a.release(pages)  # cached and unreferenced: evictable, still counted as free
    assert a.num_free == 8
    hit = a.match_prefix(hashes, len(tokens))
    # 6 tokens: at most (6 - 1) // 2 = 2 pages, so the last prompt token is computed again.
    assert hit == pages[:2] and all(a.refcount(p) == 1 for p in hit)
    a.record_lookup(len(tokens), 4)
    assert a.hit_rate == pytest.approx(4 / 6)
    assert a.match_prefix(chain_hashes([1, 2, 7, 8], 2), 4) == []  # another first page: no hit


def test_lru_eviction_takes_the_least_recently_released_cached_page_first() -> None:
    a = PageAllocator(3, 1)
    pages = a.allocate(3)
    hashes = chain_hashes([1, 2, 3], 1)
    for page, h in zip(pages, hashes, strict=True):
        a.cache_page(page, h)
    a.release([pages[1]])
    a.release([pages[0]])
    a.release([pages[2]])
    (first,) = a.allocate(1)
    assert first == pages[1]  # released first: evicted first
    assert a.match_prefix(hashes[1:2], 5) == []  # its hash is forgotten with it
    assert a.match_prefix(hashes[:1], 5) == [pages[0]]  # the others still hit
    # A hit takes a page out of the eviction order: the next eviction skips it.
    assert a.allocate(1) == [pages[2]]


def test_a_prefix_cached_twice_keeps_one_page() -> None:
    a = PageAllocator(4, 2)
    h = chain_hashes([1, 2], 2)[0]
    p, q = a.allocate(2)
    a.cache_page(p, h)
    a.cache_page(q, h)  # two sequences computed the same prefix at once
    a.release([p, q])
    assert a.match_prefix([h], 3) == [p]
    assert a.num_free == 3  # q went back to the free list, p is referenced again


def test_disabled_prefix_cache_never_hits() -> None:
    a = PageAllocator(4, 2, enable_prefix_cache=False)
    (p,) = a.allocate(1)
    h = chain_hashes([1, 2], 2)
    a.cache_page(p, h[0])
    a.release([p])
    assert a.match_prefix(h, 3) == [] and a.num_free == 4


def test_slot_pool_owners_and_misuse() -> None:
    pool = SlotPool(2)
    a, b = object(), object()
    s0, s1 = pool.acquire(a), pool.acquire(b)
    assert {s0, s1} == {0, 1} and pool.num_free == 0
    assert pool.owner(s0) is a and pool.owner(s1) is b
    with pytest.raises(OutOfSlots):
        pool.acquire(object())
    with pytest.raises(ValueError):
        pool.release(s0, b)  # not b's slot
    pool.release(s0, a)
    assert pool.owner(s0) is None and pool.num_free == 1
    with pytest.raises(ValueError):
        pool.release(s0, a)  # released twice
    assert pool.acquire(b) == s0
