"""PageAllocator / SlotAllocator: unit tests, and a hypothesis model of each (a Counter of holders)."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.cache import PageAllocator, SlotAllocator


def test_page_zero_is_never_handed_out():
    a = PageAllocator(5)
    assert a.num_free == a.capacity == 4
    pages = a.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4] and a.alloc(1) is None
    with pytest.raises(ValueError):
        a.incref([0])
    with pytest.raises(ValueError):
        a.decref([0])
    assert a.refcount(1) == 1


def test_alloc_is_all_or_nothing():
    a = PageAllocator(4)
    assert a.alloc(4) is None and a.num_free == 3
    assert a.alloc(0) == []
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_refcounting_frees_at_zero():
    a = PageAllocator(4)
    p, q = a.alloc(2)
    a.incref([p, p])
    assert a.refcount(p) == 3
    assert a.decref([p, q]) == 1 and a.is_free(q)
    assert a.decref([p, p]) == 1 and a.num_free == 3
    with pytest.raises(ValueError, match="refcount"):
        a.decref([p])
    with pytest.raises(ValueError, match="free page"):
        a.incref([p])


def test_failed_call_changes_nothing():
    a = PageAllocator(4)
    p, q = a.alloc(2)
    with pytest.raises(ValueError):
        a.decref([p, q, q])            # q has one reference, not two
    assert a.refcount(p) == 1 and a.refcount(q) == 1
    with pytest.raises(ValueError):
        a.incref([p, 3])               # 3 is free
    assert a.refcount(p) == 1
    with pytest.raises(ValueError):
        a.refcount(4)                  # out of range
    a.check_invariants()


def test_slots():
    s = SlotAllocator(3)
    assert s.capacity == s.num_free == 2
    a, b = s.alloc(), s.alloc()
    assert {a, b} == {1, 2} and s.alloc() is None
    s.free(a)
    assert s.is_free(a) and not s.is_free(b)
    with pytest.raises(ValueError, match="double free"):
        s.free(a)
    with pytest.raises(ValueError):
        s.free(0)
    with pytest.raises(ValueError):
        s.is_free(3)
    s.check_invariants()


def test_reserved_only_pools():
    assert PageAllocator(1).alloc(1) is None and SlotAllocator(1).alloc() is None
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        SlotAllocator(0)


class PageMachine(RuleBasedStateMachine):
    """Holders are modelled as a Counter of references; the allocator must agree exactly."""

    def __init__(self):
        super().__init__()
        self.a = PageAllocator(9)
        self.refs: Counter[int] = Counter()

    @rule(n=st.integers(0, 10))
    def alloc(self, n):
        got = self.a.alloc(n)
        free = 8 - len(+self.refs)
        if n > free:
            assert got is None
        else:
            assert len(set(got)) == n and not any(self.refs[p] for p in got) and 0 not in got
            self.refs.update(got)

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def incref(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(+self.refs)), max_size=4))
        self.a.incref(pages)
        self.refs.update(pages)

    @rule(data=st.data())
    def decref(self, data):
        pages = data.draw(st.lists(st.integers(1, 8), max_size=4))
        need = Counter(pages)
        if all(self.refs[p] >= c for p, c in need.items()):
            assert self.a.decref(pages) == sum(1 for p in need if self.refs[p] == need[p])
            self.refs.subtract(need)
        else:
            with pytest.raises(ValueError):
                self.a.decref(pages)

    @invariant()
    def agree(self):
        self.a.check_invariants()
        assert self.a.num_free == 8 - len(+self.refs)
        for p in range(1, 9):
            assert self.a.refcount(p) == self.refs[p]


class SlotMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = SlotAllocator(6)
        self.held: set[int] = set()

    @rule()
    def alloc(self):
        got = self.s.alloc()
        if len(self.held) == 5:
            assert got is None
        else:
            assert got not in self.held and 0 < got < 6
            self.held.add(got)

    @rule(slot=st.integers(1, 5))
    def free(self, slot):
        if slot in self.held:
            self.s.free(slot)
            self.held.discard(slot)
        else:
            with pytest.raises(ValueError):
                self.s.free(slot)

    @invariant()
    def agree(self):
        self.s.check_invariants()
        assert self.s.num_free == 5 - len(self.held)
        assert all(self.s.is_free(x) == (x not in self.held) for x in range(1, 6))


TestPageMachine = PageMachine.TestCase
TestPageMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 5), max_size=20))
@settings(max_examples=50, deadline=None)
def test_alloc_free_roundtrip(sizes):
    a = PageAllocator(11)
    held = []
    for n in sizes:
        got = a.alloc(n)
        if got is None:
            a.decref([p for chunk in held for p in chunk])
            held = []
        else:
            held.append(got)
    a.decref([p for chunk in held for p in chunk])
    assert a.num_free == 10
    a.check_invariants()
