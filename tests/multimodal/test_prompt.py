"""Placeholder expansion, prefill windows and content-keyed cache ids (ARCHITECTURE.md invariant 5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.multimodal import prompt as mm

IMG = 900


def _prompt(layout):
    """layout: ("t", n) text tokens 1..n, ("i", n) an image of n placeholders."""
    ids, counts = [], []
    for kind, n in layout:
        if kind == "t":
            ids += list(range(1, n + 1))
        else:
            ids += [7, IMG, 8]  # vision start, placeholder, vision end
            counts.append(n)
    return mm.expand_placeholders(ids, IMG, counts), counts


def _digests(k, salt=b""):
    return [bytes([i]) * 16 + salt for i in range(k)]


layouts = st.lists(st.tuples(st.sampled_from("ti"), st.integers(1, 6)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(layouts)
def test_each_image_keeps_its_own_keys(layout):
    ids, counts = _prompt(layout)
    keys = mm.cache_ids(ids, IMG, _digests(len(counts)), counts)
    places = mm.placeholder_positions(ids, IMG)
    assert len(keys) == len(ids)
    assert all(keys[p] >= mm.CACHE_ID_BASE and keys[p] < 2 * mm.CACHE_ID_BASE for p in places)
    assert [k for k, t in zip(keys, ids) if t != IMG] == [t for t in ids if t != IMG]  # text untouched
    # Image i's run is keyed by its digest: equal to the run of the same image keyed alone.
    start = 0
    for i, n in enumerate(counts):
        run = keys[places[start]: places[start] + n]
        alone = mm.cache_ids([IMG] * n, IMG, [_digests(len(counts))[i]], [n])
        assert run == alone
        start += n
    assert len(set(keys[p] for p in places)) == len(places)  # no two placeholders share a key


@settings(max_examples=100, deadline=None)
@given(layouts, st.data())
def test_a_different_image_misses_from_its_first_placeholder(layout, data):
    ids, counts = _prompt(layout)
    if not counts:
        return
    changed = data.draw(st.integers(0, len(counts) - 1))
    a = _digests(len(counts))
    b = list(a)
    b[changed] = b"\xff" * 16
    ka, kb = mm.cache_ids(ids, IMG, a, counts), mm.cache_ids(ids, IMG, b, counts)
    first = int(mm.placeholder_positions(ids, IMG)[sum(counts[:changed])])
    assert ka[:first] == kb[:first] and ka[first] != kb[first]
    assert mm.cache_ids(ids, IMG, a, counts) == ka  # same image, same place: same keys


def test_fallback_when_counts_disagree():
    ids, counts = _prompt([("t", 3), ("i", 4), ("t", 2), ("i", 3)])
    d = _digests(2)
    wrong = mm.cache_ids(ids, IMG, d, [4, 2])  # the counts do not match the placeholders
    places = mm.placeholder_positions(ids, IMG)
    assert len({wrong[p] for p in places}) == len(places)  # still position-carrying
    assert all(wrong[p] >= mm.CACHE_ID_BASE for p in places)
    assert wrong != mm.cache_ids(ids, IMG, d, counts)
    assert wrong != mm.cache_ids(ids, IMG, [d[0], b"\x09" * 16], [4, 2])  # any image changes every key


def test_expand_refuses_a_count_mismatch():
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        mm.expand_placeholders([IMG, 5, IMG], IMG, [3])


def test_window_rows():
    ids, _ = _prompt([("t", 2), ("i", 4), ("t", 3), ("i", 2)])
    places = mm.placeholder_positions(ids, IMG)  # tokens 3..6 and 12..13
    assert places.tolist() == [3, 4, 5, 6, 12, 13]
    assert mm.window_rows(places, 0, 3) == (0, 0)  # a chunk without placeholders scatters nothing
    assert mm.window_rows(places, 0, 5) == (0, 2)  # a boundary inside the first image
    assert mm.window_rows(places, 5, 13) == (2, 5)  # the rest of it and the start of the second
    assert mm.window_rows(places, 13, 20) == (5, 6)


def test_mrope_positions_continue_after_images():
    ids, _ = _prompt([("t", 2), ("i", 6), ("t", 2)])
    pos, delta = mm.mrope_positions(ids, IMG, [(1, 4, 6)], 2)  # a 2 x 3 soft-token grid
    assert pos[:3].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    img = pos[3:9]
    assert img[:, 0].tolist() == [3] * 6 and img[:, 1].tolist() == [3, 3, 3, 4, 4, 4]
    assert img[:, 2].tolist() == [3, 4, 5, 3, 4, 5]
    assert pos[9].tolist() == [6, 6, 6]  # resumes max(2, 3) after the image's start
    assert delta == int(pos.max()) + 1 - len(ids) == -3
    with pytest.raises(ValueError):
        mm.mrope_positions(ids, IMG, [(1, 4, 4)], 2)
