"""Issue 4: layouts, causal balance, window hop counts, packed documents, block-sparse."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.kernels import XlaKernel
from jax_seqpar.layouts import (permutation, permute_sequence, shard_positions,
                                unpermute_sequence)
from jax_seqpar.masks import BlockMask, MaskSpec
from jax_seqpar.parallel.schedule import ring_schedule, tile_counts

F32, BF16 = jnp.float32, jnp.bfloat16
LAYOUTS = ("contiguous", "zigzag", "striped")


# ----------------------------------------------------------------- layout algebra
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_permutation_is_a_bijection_matching_positions(layout, G):
    S = 64
    perm = permutation(layout, S, G)
    assert sorted(perm.tolist()) == list(range(S))
    T = S // G
    for i in range(G):
        pos = np.asarray(shard_positions(layout, i, T, G))
        np.testing.assert_array_equal(perm[i * T:(i + 1) * T], pos)
        assert (np.diff(pos) > 0).all()  # increasing inside a device
    x = jnp.arange(2 * S).reshape(2, S) * 3 + 1
    y = permute_sequence(x, layout, G)
    np.testing.assert_array_equal(np.asarray(y)[:, :T], np.asarray(x)[:, perm[:T]])
    np.testing.assert_array_equal(unpermute_sequence(y, layout, G), x)


def test_zigzag_and_striped_definitions():
    # BurstEngine Eq. 11 and 13, G = 4, S = 16
    np.testing.assert_array_equal(shard_positions("zigzag", 1, 4, 4, xp=np), [2, 3, 12, 13])
    np.testing.assert_array_equal(shard_positions("striped", 1, 4, 4, xp=np), [1, 5, 9, 13])
    np.testing.assert_array_equal(shard_positions("striped", 1, 4, 4, xp=np, stripe=2),
                                  [2, 3, 10, 11])


# ------------------------------------------------------------------ load balance
@pytest.mark.parametrize("G", [2, 4, 8])
def test_causal_balance(G):
    S, blk = 1024 * G, 128
    mask = MaskSpec(causal=True)
    counts = {lay: tile_counts(lay, mask, S, G, blk, blk) for lay in LAYOUTS}
    for lay in ("zigzag", "striped"):
        assert counts[lay].max() - counts[lay].min() <= 1, (lay, counts[lay])
    c = counts["contiguous"]
    assert (np.diff(c) > 0).all(), c  # device i does more than device i - 1
    assert c.max() > 1.4 * counts["zigzag"].max()  # 1.47 (G=2) .. 1.86 (G=8)
    # zigzag does exactly the contiguous total; striped adds one partly visible diagonal
    # tile row per (device, step) pair below the diagonal: G (G - 1) / 2 * b tiles
    b = S // G // blk
    assert counts["zigzag"].sum() == c.sum()
    assert counts["striped"].sum() == c.sum() + G * (G - 1) // 2 * b


@pytest.mark.parametrize("G", [4, 8])
def test_block_sparse_balance_with_striped_blocks(G):
    rng = np.random.default_rng(G)
    nb, S = 8, 64 * G * 4
    table = rng.random((nb, nb)) < 0.3
    table[np.arange(nb), np.arange(nb)] = True
    b = S // nb
    mask = MaskSpec(block_mask=BlockMask(table, b))
    striped = tile_counts("striped", mask, S, G, b // G, b // G, stripe=b // G)
    assert striped.max() - striped.min() <= 1, striped
    # every tile that is computed intersects a visible block; nothing visible is dropped
    assert striped.sum() == table.sum() * G * G


# --------------------------------------------------------------- window schedule
@pytest.mark.parametrize("window,T,G,hops", [((300, 0), 128, 8, (3, 0)),
                                             ((128, 0), 128, 8, (1, 0)),
                                             ((100, 200), 64, 8, (2, 4)),
                                             ((10, 10), 64, 4, (1, 1))])
def test_window_ring_visits_only_reachable_steps(window, T, G, hops):
    sched = ring_schedule("contiguous", MaskSpec(causal=window[1] == 0, window=window), T, G)
    assert (sched.forward, sched.backward) == hops


def test_window_hops_in_compiled_program():
    """A causal window of 20 tokens over 16-token shards needs 2 hops, not 7."""
    G, B, S, H, D = 8, 1, 128, 2, 16
    q, k, v = helpers.make_qkv(4, B=B, S=S, Hq=H, Hkv=H, D=D)
    mesh = helpers.make_mesh(G)
    rep = collective_bytes(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=True,
                                                         window=(20, 0)), q, k, v)
    per_hop = 2 * B * (S // G) * H * D * 4
    assert rep.total_bytes == 2 * per_hop
    full = collective_bytes(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=True),
                            q, k, v)
    assert full.total_bytes == (G - 1) * per_hop


# ----------------------------------------------------- outputs and gradients
@functools.lru_cache(maxsize=None)
def _fn(G, strategy, layout, backward, causal, window, with_seg, table_key, kernel):
    mesh = helpers.make_mesh(G)
    table = None if table_key is None else np.frombuffer(table_key[1], bool).reshape(
        table_key[0], table_key[0])

    def f(q, k, v, do, seg):
        def att(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, strategy=strategy, layout=layout,
                                 backward=backward, causal=causal, window=window,
                                 segment_ids=seg if with_seg else None, block_mask=table,
                                 kernel=kernel)
        out, vjp = jax.vjp(att, q, k, v)
        return out, vjp(do)

    return jax.jit(f)


def _check(G, strategy, layout, backward, causal=False, window=None, with_seg=False,
           table=None, dtype=F32, Hq=4, Hkv=2, S=64, kernel="xla", seed=0):
    B, D = 2, 16
    q, k, v = helpers.make_qkv(seed + G, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    do = helpers.make_cotangent(seed + G, q.shape, dtype)
    seg = helpers.sorted_segments(seed + G, B, S, num_docs=5) if with_seg else \
        jnp.zeros((B, S), jnp.int32)
    key = None if table is None else (table.shape[0], table.tobytes())
    out, grads = _fn(G, strategy, layout, backward, causal, window, with_seg, key, kernel)(
        q, k, v, do, seg)
    bm = None if table is None else BlockMask(table, S // table.shape[0])
    ref_out, _, ref_grads = helpers.reference_fwd_bwd(
        q, k, v, do, seg if with_seg else None, causal=causal, window=window, block_mask=bm)
    tol = helpers.tol(dtype)
    helpers.assert_close(out, ref_out, tol, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        helpers.assert_close(g, r, tol, name)


MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(11, 0)),
    "window2": dict(window=(6, 9)),
    "segments": dict(causal=True, with_seg=True),
}


def _layout_mask_runs():
    """Every (mask, layout) pair with both backward schemes: on 8 devices and on 2 or 4
    (the other scheme), and each mask once on one device.  The choices rotate so that
    each layout meets both schemes at 8 devices and at 2 and at 4, and each mask meets
    2, 4 and 8 devices (on one layout or the other)."""
    runs = []
    for m, mask in enumerate(sorted(MASKS)):
        for lay, layout in enumerate(("zigzag", "striped")):
            b8, b_small = ("kv", "q") if (lay + m // 2) % 2 == 0 else ("q", "kv")
            small = 2 if (lay + m) % 2 == 0 else 4
            runs += [(mask, layout, 8, b8), (mask, layout, small, b_small)]
        runs.append((mask, "zigzag", 1, "kv"))
    return runs


@pytest.mark.parametrize("mask,layout,G,backward", _layout_mask_runs())
def test_layouts_masks_match_reference(G, backward, layout, mask):
    _check(G, "ring", layout, backward, **MASKS[mask])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backward", ["kv", "q"])
def test_layouts_bf16_both_backwards(layout, backward):
    _check(4, "ring", layout, backward, causal=True, with_seg=True, dtype=BF16)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strategy", ["allgather", "tree"])
def test_allgather_and_tree_layouts(layout, strategy):
    _check(4, strategy, layout, "kv", causal=True, window=(13, 0), with_seg=True)


def _table(seed, nb, density=0.3, causal=False):
    rng = np.random.default_rng(seed)
    t = rng.random((nb, nb)) < density
    t[np.arange(nb), np.arange(nb)] = True
    return np.tril(t) if causal else t


@pytest.mark.parametrize("G,layout", [(1, "contiguous")] + [
    (G, layout) for G in (2, 4, 8) for layout in LAYOUTS])  # on one device all are one
def test_block_sparse_matches_reference(G, layout):
    S, nb = 128, 4  # blocks of 32 tokens: stripes of 32 / G
    blk = S // nb // G if layout == "striped" else 16
    _check(G, "ring", layout, "q" if G % 4 == 0 else "kv", causal=G % 2 == 0,
           table=_table(G, nb), S=S, kernel=XlaKernel(block_q=blk, block_k=blk))


def test_block_sparse_rows_without_keys():
    """A query block that sees no key block gives out = 0 and zero, finite gradients."""
    table = _table(3, 4)
    table[1, :] = False
    _check(4, "ring", "striped", "kv", table=table, S=128)


def test_permuted_path_equals_natural_path():
    G, S = 4, 64
    mesh = helpers.make_mesh(G)
    q, k, v = helpers.make_qkv(5, S=S, Hq=4, Hkv=2)
    seg = helpers.sorted_segments(5, 2, S)
    kw = dict(mesh=mesh, layout="zigzag", causal=True)
    natural = jsp.attention(q, k, v, segment_ids=seg, **kw)
    p = lambda x: permute_sequence(x, "zigzag", G)  # noqa: E731
    permuted = jsp.attention(p(q), p(k), p(v), segment_ids=p(seg), permuted=True, **kw)
    back = np.asarray(permuted)[:, np.argsort(permutation("zigzag", S, G))]
    chex.assert_trees_all_close(back, np.asarray(natural), rtol=1e-6, atol=1e-6)


def test_layout_errors():
    mesh = helpers.make_mesh(4)
    q, k, v = helpers.make_qkv(6, S=36, Hq=4, Hkv=2)
    with pytest.raises(ValueError, match="2\\*num_shards=4"):
        jsp.attention(q, k, v, mesh=mesh, layout="zigzag")  # 36 % 8 != 0
    q, k, v = helpers.make_qkv(6, S=64, Hq=4, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        jsp.attention(q, k, v, mesh=mesh, layout="striped", block_mask=np.eye(32, dtype=bool))
    with pytest.raises(ValueError, match="divide"):
        jsp.attention(q, k, v, mesh=mesh, block_mask=np.eye(5, dtype=bool))
    with pytest.raises(TypeError, match="bool"):
        jsp.attention(q, k, v, mesh=mesh, block_mask=np.eye(4))
    with pytest.raises(ValueError, match="shape"):
        jsp.attention(q, k, v, mesh=mesh, block_mask=np.ones((4, 2), bool))
