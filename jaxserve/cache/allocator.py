"""Host-side allocators for the two device pools: KV pages and linear-state slots.

Both hand out integer ids into pools that live on the device; neither ever sees array contents.
Id 0 of each pool is reserved: page 0 is the null page (page-table entries past a row's pages name
it; a decode batch's padding rows write it), slot 0 the null slot (the padding rows' slot).
It is never handed out, so a real page or slot can never be clobbered by padding.

Invariants (``check_invariants``):
  * an id is free  <=>  it is on the free list  <=>  (pages) its refcount is 0;
  * the free list holds no duplicates and never id 0;
  * every mutating call validates all its arguments before changing anything, so a call that
    raises leaves the allocator untouched.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Iterable


class PageAllocator:
    """Reference-counted KV pages. A page is shared by every holder (requests, the radix tree)
    that increfs it and returns to the free list when its last holder decrefs it."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out 1, 2, 3, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    def is_free(self, page: int) -> bool:
        return self.refcount(page) == 0

    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages with refcount 1, or None (and nothing allocated) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference per occurrence. Only pages someone already holds can be shared."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if self._ref[p] == 0:
                raise ValueError(f"incref of free page {p}")
        for p in pages:
            self._ref[p] += 1

    def decref(self, pages: Iterable[int]) -> int:
        """Drop one reference per occurrence; pages reaching 0 are freed. Returns how many were
        freed. Dropping more references than a page has raises (a double free)."""
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_id(p)
            if self._ref[p] < c:
                raise ValueError(f"decref of page {p} x{c} but its refcount is {self._ref[p]}")
        freed = 0
        for p, c in counts.items():
            self._ref[p] -= c
            if self._ref[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "page free list holds duplicates"
        assert 0 not in free and self._ref[0] == 0, "null page 0 was handed out or freed"
        for p in range(1, self.num_pages):
            assert self._ref[p] >= 0, f"page {p} has negative refcount"
            assert (self._ref[p] == 0) == (p in free), (
                f"page {p}: refcount {self._ref[p]} but {'on' if p in free else 'off'} the free list")

    def _check_id(self, page: int) -> None:
        # ``type(...) is int`` first: the ABC check costs ~1 us and the scheduler asks per page per step.
        if not ((type(page) is int or isinstance(page, numbers.Integral)) and 0 < page < self.num_pages):
            raise ValueError(f"page id {page!r} is out of range or the reserved null page")


class SlotAllocator:
    """Linear-state slots: one owner each, no sharing. (A slot id shared between the radix tree
    and a request is exactly the aliasing the seed story warns about; copy-on-donate means the
    tree always gets its own slot, so single ownership is enough.)"""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._is_free = [False] + [True] * (num_slots - 1)
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def is_free(self, slot: int) -> bool:
        self._check_id(slot)
        return self._is_free[slot]

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        self._check_id(slot)
        if self._is_free[slot]:
            raise ValueError(f"double free of slot {slot}")
        self._is_free[slot] = True
        self._free.append(slot)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "slot free list holds duplicates"
        assert 0 not in free and not self._is_free[0], "null slot 0 was handed out or freed"
        for s in range(1, self.num_slots):
            assert self._is_free[s] == (s in free), f"slot {s}: free flag and free list disagree"

    def _check_id(self, slot: int) -> None:
        if not ((type(slot) is int or isinstance(slot, numbers.Integral)) and 0 < slot < self.num_slots):
            raise ValueError(f"slot id {slot!r} is out of range or the reserved null slot")
