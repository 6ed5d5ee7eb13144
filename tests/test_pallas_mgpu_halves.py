"""The fused Hopper backward's key blocks paired within documents (``pallas_mgpu_halves``):
the pairing, and the tile lists run through a NumPy model of the kernel's step (its mask
classes, each consumer's keys where the row names them, the spare block) against exact
gradients.  The kernel itself needs a GPU (``benchmarks/packed.py``); its lowering is
tested in ``test_pallas_mgpu.py``."""

import numpy as np
import pytest

import jax.numpy as jnp

from jax_seqpar.kernels.pallas_common import MASK_CLASSES
from jax_seqpar.kernels.pallas_mgpu_halves import (halves_tile_lists, max_ctas,
                                                   pair_halves, spare_id)
from jax_seqpar.masks import MaskSpec

_I32 = np.iinfo(np.int32)


def _ids(lens, L, ids=None):
    ids = range(len(lens)) if ids is None else ids
    seg = np.concatenate([np.full(n, i, np.int32) for i, n in zip(ids, lens)])
    return np.concatenate([seg, np.full(L - len(seg), seg[-1], np.int32)])


def test_halves_pair_within_long_documents():
    # halves of 16 keys; runs of 40 keys or more start regions: at 40 (its half 2 holds
    # keys 32..47, ending in it), at 100 (half 6); the run of 10 at 90 joins the region
    # before it
    lens, bk = [40, 50, 10, 60], 16
    T = sum(lens)
    L = -(-T // (2 * bk)) * (2 * bk)
    f0, f1, live = (np.asarray(x)[0] for x in pair_halves(
        jnp.asarray(_ids(lens, L))[None], T, bk, 40, jnp.asarray(True)))
    assert f0.shape == (max_ctas(L, bk, 40),)
    got = [(int(a), int(b)) for a, b, u in zip(f0, f1, live) if u]
    # regions: halves 0-1, 2-5, 6-9 (T = 160: ten halves); spare row L for a lone half
    assert got == [(0, 16), (32, 48), (64, 80), (96, 112), (128, 144)]
    lens = [40, 41, 79]  # regions at halves 0, 2 (key 40), 5 (key 81): 2, 3 and 5 halves
    f0, f1, live = (np.asarray(x)[0] for x in pair_halves(
        jnp.asarray(_ids(lens, L))[None], T, bk, 40, jnp.asarray(True)))
    got = [(int(a), int(b)) for a, b, u in zip(f0, f1, live) if u]
    assert got == [(0, 16), (32, 48), (64, L), (80, 96), (112, 128), (144, L)]
    # without a free id, blocks stay on multiples of 2 * bk
    f0, f1, live = (np.asarray(x)[0] for x in pair_halves(
        jnp.asarray(_ids(lens, L))[None], T, bk, 40, jnp.asarray(False)))
    assert [(int(a), int(b)) for a, b, u in zip(f0, f1, live) if u] == [
        (32 * i, 32 * i + 16) for i in range(5)]


def test_spare_id_is_free():
    seg = jnp.asarray([[3, 3, 7]], jnp.int32)
    assert int(spare_id(seg, seg)[0]) == 2 and bool(spare_id(seg, seg)[1])
    low = jnp.asarray([[_I32.min, 5]], jnp.int32)
    assert int(spare_id(low, low)[0]) == 6
    both = jnp.asarray([[_I32.min, _I32.max]], jnp.int32)
    assert not bool(spare_id(both, both)[1])


def _masked(mode, mask, qpos, kpos, qseg, kseg):
    pos, seg = mode
    ok = np.ones((len(qpos), len(kpos)), bool)
    d = kpos[None, :] - qpos[:, None]
    if pos and mask.right_limit is not None:
        ok &= d <= mask.right_limit
    if pos and mask.left_limit is not None:
        ok &= -d <= mask.left_limit
    if seg == "pair":
        ok &= qseg[:, None] == kseg[None, :]
    return ok


def _model(tbl, order, q, k, v, do, lse, delta, qpos, qseg, kpos, kseg, mask, bq, bk):
    """What the fused kernel computes from the lists: per CTA (launch order) its query
    steps, each consumer's keys where the row names them (the spare block's K and V
    zero), each tile's mask from its class, dQ added for every step row, dK and dV
    stored for each consumer's block (each key row at most once; the spare's dropped)."""
    Lq, D = q.shape
    Lk = k.shape[0]  # with the spare block
    dq = np.zeros((Lq, D))
    dk, dv = np.full((Lk, D), np.nan), np.full((Lk, D), np.nan)
    n = tbl.shape[-1]
    for cta in order:
        row = tbl[cta]
        count, n_full = row[0], row[1]
        f0, f1 = int(row[n - 5]), int(row[n - 4])
        assert f0 % bk == 0 and f1 % bk == 0
        bounds = [n_full, *row[n - 3:], count]
        keys = np.concatenate([f0 + np.arange(bk), f1 + np.arange(bk)])
        gk, gv = np.zeros((2 * bk, D)), np.zeros((2 * bk, D))
        for t in range(count):
            mode = None
            for i, m in enumerate(MASK_CLASSES):
                if bounds[i] <= t < bounds[i + 1]:
                    mode = m
            rows = row[t + 2] * bq + np.arange(bq)
            s = q[rows] @ k[keys].T
            lse_r = lse[rows]
            if mode is not None:
                if mode[1] == "fold":
                    lse_r = np.where(qseg[rows] == kseg[f0], lse_r, np.inf)
                ok = _masked(mode, mask, qpos[rows], kpos[keys], qseg[rows], kseg[keys])
                s = np.where(ok, s, -np.inf)
            p = np.exp(s - lse_r[:, None])
            ds = p * (do[rows] @ v[keys].T - delta[rows][:, None])
            gv += p.T @ do[rows]
            gk += ds.T @ q[rows]
            dq[rows] += ds @ k[keys]
        for w, f in enumerate((f0, f1)):
            if f >= Lk - bk:
                continue  # the spare block's rows: dropped
            own = slice(f, f + bk)
            assert np.isnan(dk[own]).all(), "a key row stored twice"
            dk[own], dv[own] = gk[w * bk:(w + 1) * bk], gv[w * bk:(w + 1) * bk]
    return dq, dk, dv


@pytest.mark.parametrize("lens,window,ids,want_lone", [
    ([37, 70, 13, 40], None, None, 2), ([60, 3, 120, 33], 20, None, 2),
    ([256], None, None, 0), ([40, 30, 50, 21], None, [0, 1, 0, 2], 4),
    ([43, 40, 20], None, [0, 1, 0], 2), ([24, 24, 40, 9], None, [_I32.min, 5, _I32.max, 6], 0)])
def test_lists_give_exact_gradients(lens, window, ids, want_lone):
    """The lists through the kernel's model equal the gradients of causal attention
    within documents (float64): regions of their own and joined ones, one-half CTAs with
    their spare keys, windows, one long document, an id that comes back, and ids at
    both ends of int32 (no spare id: the blocks stay on multiples)."""
    rng = np.random.default_rng(len(lens) + sum(lens))
    T = sum(lens)
    bq, bk = 8, 8
    Lq, Lk = -(-T // (2 * bq)) * (2 * bq), -(-T // (2 * bk)) * (2 * bk)
    D = 8
    seg = _ids(lens, T, ids)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    if ids is not None:
        pos = np.arange(T, dtype=np.int32)
    q, k, v, do = (rng.standard_normal((T, D)) for _ in range(4))
    q = q / np.sqrt(D)
    mask = MaskSpec(causal=True, window=window) if window else MaskSpec(causal=True)
    ok = _masked((True, "pair"), mask, pos, pos, seg, seg)
    s = np.where(ok, q @ k.T, -np.inf)
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    p = np.exp(s - lse[:, None])
    delta = (do * (p @ v)).sum(1)
    ds = p * (do @ v.T - delta[:, None])
    want = (ds @ k, ds.T @ q, p.T @ do)

    def pad(x, L, edge):  # the padding of pallas_mgpu_bwd.mgpu_bwd
        fill = x[-1] if edge else np.zeros_like(x[-1])
        return np.concatenate([x, np.broadcast_to(fill, (L - T,) + x.shape[1:])])
    spare = int(spare_id(jnp.asarray(seg)[None], jnp.asarray(seg)[None])[0])
    qpos, qseg = pad(pos, Lq, True), pad(seg, Lq, True)
    kpos = np.concatenate([pad(pos, Lk, True), np.full(bk, pos[-1], np.int32)])
    kseg = np.concatenate([pad(seg, Lk, True), np.full(bk, spare, np.int32)])
    tbl, order = halves_tile_lists(mask, jnp.asarray(qpos)[None], jnp.asarray(kpos),
                                   jnp.asarray(qseg)[None], jnp.asarray(kseg)[None], T, bq,
                                   bk, anchor=24)
    tbl, order = np.asarray(tbl)[0], np.asarray(order)[0]
    assert sorted(order.tolist()) == list(range(tbl.shape[0]))
    kz = lambda x: np.concatenate([pad(x, Lk, False), np.zeros((bk, D))])  # noqa: E731
    got = _model(tbl, order, pad(q, Lq, False), kz(k), kz(v), pad(do, Lq, False),
                 np.concatenate([lse, np.full(Lq - T, np.inf)]), pad(delta, Lq, False),
                 qpos, qseg, kpos, kseg, mask, bq, bk)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g[:T], w, atol=1e-10, rtol=1e-10)
    n = tbl.shape[-1]
    lone = int(((tbl[:, n - 5] < Lk) & (tbl[:, n - 4] == Lk)).sum())
    assert lone == want_lone  # one-half CTAs: regions of an odd number of halves
