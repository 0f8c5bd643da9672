"""gdn_decode (Mosaic GPU kernel, GPU interpret mode on CPU) against the jnp references.

Every case runs the kernel on a random batch of single tokens whose states sit at random slots of
a larger pool, and compares with ``gdn_recurrent`` / ``kda_recurrent`` run on the same tokens with
the gathered states: o and the updated slots must match, and every slot the batch does not name
must come back bit-identical. Shapes are the smallest the kernel's tiling allows (dk a multiple
of 64: WGMMA row tiles; dv tiles of 32 fp32 columns), so each case compiles in a few seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn_decode import gdn_decode, gdn_decode_jnp, gdn_decode_pool
from pallas_kernels.gdn_reference import gdn_recurrent
from pallas_kernels.kda_reference import kda_recurrent

TOL = 2e-5  # both sides fp32; the kernel folds the L2 norms in after its reductions


def make_inputs(rng, *, B, Hk, Hv, dk, dv, kda, num_slots, dtype=np.float32):
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    g_shape = (B, Hv, dk) if kda else (B, Hv)
    x = dict(q=normal(B, Hk, dk), k=normal(B, Hk, dk), v=normal(B, Hv, dv),
             g=-rng.uniform(0, 2, size=g_shape).astype(np.float32),
             beta=rng.uniform(0, 1, size=(B, Hv)).astype(np.float32))
    x = {n: jnp.asarray(a, dtype) for n, a in x.items()}
    pool = normal(num_slots, Hv, dk, dv)
    return x, pool


def reference(x, pool, slots, *, kda, **kw):
    """The references on one token per sequence, states gathered from and scattered to the pool."""
    B = x["q"].shape[0]
    fn = kda_recurrent if kda else gdn_recurrent
    o, final, _ = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=jnp.arange(B + 1, dtype=jnp.int32),
                     initial_state=jnp.asarray(pool)[slots], **kw)
    new_pool = np.array(pool)
    new_pool[np.asarray(slots)] = np.asarray(final)
    return np.asarray(o, np.float32), new_pool


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def check(x, pool, slots, *, kda, tol=TOL, null_rows=(), block_dv=None, **variant):
    o_ref, pool_ref = reference(x, pool, slots, kda=kda)
    o, new_pool = gdn_decode(**x, state_pool=jnp.asarray(pool), slots=jnp.asarray(slots, jnp.int32),
                             block_dv=block_dv, interpret=True, **variant)
    o, new_pool = np.asarray(o, np.float32), np.asarray(new_pool)
    real = np.array([b for b in range(len(slots)) if b not in null_rows])
    assert np.isfinite(o[real]).all() and np.isfinite(new_pool[1:]).all()
    assert rel(o[real], o_ref[real]) < tol
    named = sorted(set(int(s) for s in np.asarray(slots)[real]))
    assert rel(new_pool[named], pool_ref[named]) < tol
    untouched = [s for s in range(1, pool.shape[0]) if s not in named]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])  # bit-identical


SIMPLE = dict(persistent=False)  # one block per tile; the default is the persistent kernel
PERSISTENT3 = dict(persistent=True, stages=3, blocks_per_sm=2)  # 2 blocks under interpretation (1 "SM")
PERSISTENT2 = dict(persistent=True, stages=2, blocks_per_sm=3)


@pytest.mark.parametrize("kda,B,Hk,Hv,dk,dv,block_dv,variant", [
    (False, 1, 1, 2, 64, 32, None, SIMPLE),
    (False, 3, 2, 4, 64, 64, 64, PERSISTENT3),
    (True, 2, 1, 2, 64, 64, None, SIMPLE),
    (True, 5, 1, 2, 64, 32, None, PERSISTENT2),
], ids=["gdn-b1-simple", "gdn-b3-gqa-persistent", "kda-b2-simple", "kda-b5-persistent"])
def test_matches_reference_at_random_slots(kda, B, Hk, Hv, dk, dv, block_dv, variant):
    """Random distinct slots in a pool twice the batch; from B=3 on, the last row is padding (slot 0).
    The persistent kernel walks several tiles per block through its SMEM ring here."""
    rng = np.random.default_rng(B * 10 + Hv + kda)
    x, pool = make_inputs(rng, B=B, Hk=Hk, Hv=Hv, dk=dk, dv=dv, kda=kda, num_slots=2 * B + 3)
    slots = rng.permutation(np.arange(1, 2 * B + 3))[:B].astype(np.int32)
    null_rows = ()
    if B >= 3:
        slots[-1], null_rows = 0, (B - 1,)
    check(x, pool, slots, kda=kda, null_rows=null_rows, block_dv=block_dv, **variant)


def test_several_null_slot_rows():
    """Several padding rows (all slot 0) leave every real slot and every other slot alone."""
    rng = np.random.default_rng(7)
    x, pool = make_inputs(rng, B=4, Hk=1, Hv=2, dk=64, dv=32, kda=False, num_slots=6)
    slots = np.array([4, 0, 2, 0], np.int32)
    check(x, pool, slots, kda=False, null_rows=(1, 3))


def test_options_and_narrow_tiles():
    """scale, use_qk_l2norm=False and an explicit dv tile (two blocks per head) go through."""
    rng = np.random.default_rng(3)
    x, pool = make_inputs(rng, B=2, Hk=1, Hv=2, dk=64, dv=64, kda=False, num_slots=4)
    x["q"], x["k"] = x["q"] * 0.1, x["k"] * 0.1  # unnormalised keys must stay small to be stable
    slots = np.array([3, 1], np.int32)
    o_ref, pool_ref = reference(x, pool, slots, kda=False, scale=0.3, use_qk_l2norm=False)
    o, new_pool = gdn_decode(**x, state_pool=jnp.asarray(pool), slots=jnp.asarray(slots), scale=0.3,
                             use_qk_l2norm=False, block_dv=32, interpret=True, **SIMPLE)
    assert rel(o, o_ref) < TOL and rel(np.asarray(new_pool)[[1, 3]], pool_ref[[1, 3]]) < TOL
    np.testing.assert_array_equal(np.asarray(new_pool)[2], pool[2])


def test_repeated_steps_on_one_pool_match_two_token_recurrence():
    """Two decode steps (persistent kernel) through the same donated, aliased pool == the recurrence
    over 2 tokens, with the batch rows permuted between the steps so each row's slot moves."""
    rng = np.random.default_rng(11)
    B, Hk, Hv, dk, dv = 3, 1, 2, 64, 32
    x1, pool = make_inputs(rng, B=B, Hk=Hk, Hv=Hv, dk=dk, dv=dv, kda=True, num_slots=8)
    x2, _ = make_inputs(rng, B=B, Hk=Hk, Hv=Hv, dk=dk, dv=dv, kda=True, num_slots=1)
    slots = np.array([6, 2, 5], np.int32)
    perm = np.array([2, 0, 1])
    step = jax.jit(lambda x, p, s: gdn_decode_pool(**x, state_pool=p, slots=s, interpret=True, **PERSISTENT3),
                   donate_argnums=(1,))
    o1, p1 = step(x1, jnp.asarray(pool), jnp.asarray(slots))
    o2, p2 = step({n: a[perm] for n, a in x2.items()}, p1, jnp.asarray(slots[perm]))
    # reference: tokens interleaved per sequence: [x1[b], x2[b]] for each b
    packed = {n: jnp.stack([x1[n], x2[n]], axis=1).reshape(2 * B, *x1[n].shape[1:]) for n in x1}
    o_ref, final, _ = kda_recurrent(**packed, cu_seqlens=jnp.arange(0, 2 * B + 1, 2, dtype=jnp.int32),
                                    initial_state=jnp.asarray(pool)[slots])
    o_ref = np.asarray(o_ref).reshape(B, 2, Hv, dv)
    assert rel(o1, o_ref[:, 0]) < TOL
    assert rel(np.asarray(o2)[np.argsort(perm)], o_ref[:, 1]) < TOL
    p2 = np.asarray(p2)
    assert rel(p2[slots], final) < TOL
    others = [s for s in range(8) if s not in slots]
    np.testing.assert_array_equal(p2[others], pool[others])


def test_bf16_inputs():
    """Model-dtype activations (bf16) with fp32 state: o comes back bf16, state stays fp32."""
    rng = np.random.default_rng(5)
    x, pool = make_inputs(rng, B=2, Hk=1, Hv=2, dk=64, dv=64, kda=True, num_slots=4, dtype=jnp.bfloat16)
    slots = np.array([1, 3], np.int32)
    o_ref, pool_ref = reference(x, pool, slots, kda=True)
    o, new_pool = gdn_decode(**x, state_pool=jnp.asarray(pool), slots=jnp.asarray(slots), interpret=True)
    assert o.dtype == jnp.bfloat16 and new_pool.dtype == jnp.float32
    assert rel(o, o_ref) < 1e-2  # o rounded to bf16 on both sides
    assert rel(np.asarray(new_pool)[[1, 3]], pool_ref[[1, 3]]) < TOL


def test_jnp_baseline_matches_reference():
    """gdn_decode_jnp (the XLA baseline in the benchmarks) computes the same step."""
    rng = np.random.default_rng(9)
    for kda in (False, True):
        x, pool = make_inputs(rng, B=3, Hk=1, Hv=2, dk=16, dv=8, kda=kda, num_slots=5)
        slots = np.array([4, 1, 2], np.int32)
        o_ref, pool_ref = reference(x, pool, slots, kda=kda)
        o, new_pool = gdn_decode_jnp(**x, state_pool=jnp.asarray(pool), slots=jnp.asarray(slots))
        assert rel(o, o_ref) < TOL and rel(new_pool, pool_ref) < TOL


def test_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    x, pool = make_inputs(rng, B=2, Hk=1, Hv=2, dk=64, dv=32, kda=False, num_slots=3)
    with pytest.raises(ValueError, match="g"):
        gdn_decode_pool(**{**x, "g": x["g"][:, :1]}, state_pool=jnp.asarray(pool), slots=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="state_pool"):
        gdn_decode_pool(**x, state_pool=jnp.asarray(pool, jnp.bfloat16), slots=jnp.zeros(2, jnp.int32))


def test_stacked_pool_layers_update_only_their_layer():
    """Serving form: a ``[layers, slots, ...]`` pool, ``layer`` an int or a traced scalar, read and
    write slots apart. The named layer's written slots hold the recurrence; every other entry of
    every layer comes back bit-identical."""
    rng = np.random.default_rng(5)
    B, Hk, Hv, dk, dv, L, S = 2, 1, 2, 64, 32, 3, 5
    x, _ = make_inputs(rng, B=B, Hk=Hk, Hv=Hv, dk=dk, dv=dv, kda=False, num_slots=1)
    pool = rng.normal(size=(L, S, Hv, dk, dv)).astype(np.float32)
    read, write = np.array([3, 1], np.int32), np.array([4, 2], np.int32)
    o_want, after = reference(x, pool[1], read, kda=False)
    want = after[read]  # the states after the token, which the kernel puts in the write slots
    for layer in (1, jnp.int32(1)):
        o, new = jax.jit(lambda x, p, r, w, layer: gdn_decode_pool(**x, state_pool=p, slots=r, write_slots=w,
                                                                    layer=layer, interpret=True))(
            x, jnp.asarray(pool), jnp.asarray(read), jnp.asarray(write), layer)
        new = np.asarray(new)
        assert rel(o, o_want) < TOL and rel(new[1, write], want) < TOL
        untouched = np.ones((L, S), bool)
        untouched[1, write] = False
        np.testing.assert_array_equal(new[untouched], pool[untouched])


def test_every_layer_shares_one_lowered_kernel():
    """Three layers' decode steps in one program lower the kernel once (one private function,
    three calls, no more custom calls than one layer has): a Mosaic GPU module lowered per layer
    made most of a real-size decode program's lowering time. Lowered for the GPU platform (nothing
    runs; a CPU suffices)."""
    rng = np.random.default_rng(6)
    x, _ = make_inputs(rng, B=2, Hk=1, Hv=2, dk=64, dv=64, kda=False, num_slots=1)
    pool = jnp.zeros((3, 4, 2, 64, 64), jnp.float32)

    def lowered(layers):
        def step(x, pool, slots):
            outs = []
            for layer in range(layers):
                o, pool = gdn_decode_pool(**x, state_pool=pool, slots=slots, layer=layer)
                outs.append(o)
            return outs, pool
        return jax.jit(step).trace(x, pool, jnp.array([1, 2], jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()

    one, three = lowered(1), lowered(3)
    assert three.count("func.func private @_pool_step") == 1 and three.count("call @_pool_step") == 3
    assert three.count("stablehlo.custom_call") == one.count("stablehlo.custom_call")
    assert len(three) < 1.1 * len(one)
