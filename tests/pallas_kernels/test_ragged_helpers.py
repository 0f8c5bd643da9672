"""The ragged-batch helpers of ``pallas_kernels`` (its ``__init__``) against plain-Python models."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import first_of_each


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=24))
def test_first_of_each_keeps_the_first_kept_entry_of_each_id(entries):
    """Kept entries stay kept unless an earlier kept entry has their id; dropped entries stay
    dropped and never shadow a later one; the kept ids come out distinct."""
    ids, keep = (np.array(x) for x in zip(*entries))
    seen, want = set(), []
    for i, k in zip(ids, keep):
        want.append(bool(k) and i not in seen)
        if k:
            seen.add(i)
    got = np.asarray(first_of_each(jnp.asarray(ids, jnp.int32), jnp.asarray(keep)))
    assert got.tolist() == want
    assert len(set(ids[got])) == int(got.sum())
