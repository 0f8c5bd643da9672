"""Mosaic GPU kernels lower to the same bytes every time (``pallas_kernels/stable_names.py``): the
persistent compilation cache's key of a program must not depend on what the process lowered before
it, or on which thread lowered it."""

import concurrent.futures
import hashlib

import jax
import jax.numpy as jnp
from jax._src import cache_key

from pallas_kernels import linear_small as ls
from pallas_kernels import stable_names


def _key(lowered) -> str:
    """The hash of the canonical module JAX's persistent cache keys a program by."""
    return hashlib.sha256(cache_key._canonicalize_ir(lowered.compiler_ir("stablehlo"), False)).hexdigest()


def _lower(m: int, fresh: bool = True):
    """A program of two projections, lowered afresh (``fresh``: JAX's lowering caches would hand
    back the earlier lowering of a kernel, hiding what a new process, or one that lowered other
    programs first, gets)."""
    if fresh:
        jax.clear_caches()
    f = jax.ShapeDtypeStruct
    x, w = f((m, 2048), jnp.bfloat16), f((2048, 2048), jnp.bfloat16)
    return jax.jit(lambda x, w: ls.linear_small(x, w) + ls.linear_small(x, w)).trace(x, w).lower(
        lowering_platforms=("cuda",))


def test_a_program_lowers_to_one_key_whatever_was_lowered_before():
    assert stable_names.install()  # the package installs it; installing again is a no-op
    first = _key(_lower(1))
    _lower(8), _lower(16)  # kernels of the same name lowered in between
    assert _key(_lower(1)) == first


def test_lowering_on_threads_in_any_order_gives_the_same_keys():
    serial = [_key(_lower(m)) for m in (1, 8, 16, 32)]
    jax.clear_caches()  # once: clearing under another thread's lowering would split its call sites
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        threaded = list(ex.map(lambda m: _key(_lower(m, fresh=False)), (32, 16, 8, 1)))
    assert threaded[::-1] == serial

