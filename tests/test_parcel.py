"""``ring_common.Parcel``: whatever a ring hop carries travels as one buffer, bit for bit.

The ring forward's K, V and segment ids, the ``q`` backward's Q, dO, D, lse and ids, and
the ``kv`` backward's dK, dV accumulators each make one collective per hop
(``PACK_HOPS``); with ``PACK_HOPS = False`` each array is its own collective.  Both forms
must give the same bits.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.parallel import ring_common
from jax_seqpar.parallel.ring_common import Parcel


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" or x.dtype == jnp.bfloat16 \
        else x


def test_round_trip_of_mixed_dtypes_is_exact():
    key = jax.random.PRNGKey(3)
    q = jax.random.normal(key, (2, 5, 3, 4), jnp.float32).astype(jnp.bfloat16)
    # float32 values whose bits a float conversion would not keep: NaN payloads, -0, inf
    special = jnp.array([np.nan, -0.0, np.inf, -np.inf, 1e-45], jnp.float32)
    nan_payload = jax.lax.bitcast_convert_type(jnp.uint32(0x7FC01234), jnp.float32)
    lse = jnp.concatenate([special, nan_payload[None]]).reshape(2, 3)
    seg = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) - 4
    tree = (q, None, {"lse": lse, "seg": seg})
    p = Parcel.of(tree, packed=True)
    assert len(jax.tree.leaves(p)) == 1  # one buffer: one collective
    (buf,) = jax.tree.leaves(p)
    assert buf.dtype == jnp.uint16 and buf.ndim == 1  # the smallest item size
    assert buf.size * 2 == q.size * 2 + lse.size * 4 + seg.size * 4  # the parts' bytes
    back = p.unpack()
    assert back[1] is None
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # a bool beside them (XLA bitcasts no bools): one byte each, in a uint8 carrier
    flags = jnp.array([[True, False, True]])
    p = Parcel.of((flags, q), packed=True)
    assert jax.tree.leaves(p)[0].dtype == jnp.uint8
    got_flags, got_q = p.unpack()
    assert got_flags.dtype == jnp.bool_
    np.testing.assert_array_equal(got_flags, flags)
    np.testing.assert_array_equal(_bits(got_q), _bits(q))


def test_one_dtype_needs_no_bitcast_and_parcels_add():
    a = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    b = jnp.full((4,), 2.0, jnp.float32)
    p = Parcel.of((a, b), packed=True)
    (buf,) = jax.tree.leaves(p)
    assert buf.dtype == jnp.float32 and buf.shape == (10,)
    s = ring_common.add(p, Parcel.of((a, b), packed=True))  # the accumulators' sum
    np.testing.assert_array_equal(s.unpack()[0], 2 * a)
    np.testing.assert_array_equal(s.unpack()[1], 2 * b)
    loose = Parcel.of((a, b), packed=False)  # PACK_HOPS = False: the arrays themselves
    assert [x.shape for x in jax.tree.leaves(loose)] == [(2, 3), (4,)]
    with pytest.raises(ValueError, match="at least one array"):
        Parcel.of((None,))


@functools.lru_cache(maxsize=None)
def _run(backward, packed):
    """Forward and gradients of a causal zigzag ring on 4 devices with packed documents,
    and the count of collective-permutes in its compiled program."""
    G, S = 4, 64
    q, k, v = helpers.make_qkv(11, B=1, S=S, Hq=4, Hkv=2, D=16)
    do = helpers.make_cotangent(11, q.shape)
    seg = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) // 24, (1, S))
    mesh = helpers.make_mesh(G)

    def f(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=True, layout="zigzag",
                             segment_ids=seg, backward=backward, permuted=True)

    def step(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(do)

    saved, ring_common.PACK_HOPS = ring_common.PACK_HOPS, packed
    try:  # read when the ring is traced
        fn = jax.jit(step)
        text = fn.lower(q, k, v, do).compile().as_text()
        out = jax.block_until_ready(fn(q, k, v, do))
    finally:
        ring_common.PACK_HOPS = saved
    permutes = len(re.findall(r"= \S+ collective-permute(?:-start)?\(", text))
    return out, permutes


@pytest.mark.parametrize("backward", ["kv", "q"])
def test_packed_hops_are_fewer_collectives_with_the_same_bits(backward):
    """Rolled ring, G = 4 (3 hops): in the program's text the forward's first hop and
    its loop body, the backward's the same plus the accumulator's hops and its hop
    home.  Packed, each is one collective; apart, the forward sends K, V and ids
    (3 each), the ``kv`` backward those and dK, dV (2 each), the ``q`` backward Q, dO, D,
    lse and ids (5 each) and dQ.  Apart, the ``kv`` backward's first hop sends the very
    arrays of the forward's, and XLA merges the two (CSE): that hop is then free, and its
    blocks stay alive from the forward to the backward, the hazard that the packed
    form's order (V before K in the forward) avoids."""
    packed, n_packed = _run(backward, True)
    apart, n_apart = _run(backward, False)
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(apart)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ring_common.PACK_HOPS  # put back
    assert n_packed < n_apart
    # forward: 3 arrays per activation hop; backward: activations and accumulators
    per_hop = {"kv": (3, 3, 2), "q": (3, 5, 1)}[backward]
    fwd_hops, bwd_act, bwd_acc = 2, 3, 3  # as counted by tests/test_overlap.py
    assert n_packed == fwd_hops + bwd_act + bwd_acc
    merged = 3 if backward == "kv" else 0
    assert n_apart == (per_hop[0] * fwd_hops + per_hop[1] * bwd_act
                       + per_hop[2] * bwd_acc) - merged
