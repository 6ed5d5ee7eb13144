"""The fused Hopper backward's blocks laid per document (``pallas_mgpu_docs``): the
blocks, and the tile lists run through a NumPy model of the kernel's step (its mask
classes, the live rows of each block, the partial stores) against exact gradients.
The kernel itself needs a GPU (``benchmarks/hopper_tiles_gpu.sh check``); its lowering
is tested in ``test_pallas_mgpu.py``."""

import numpy as np
import pytest

import jax.numpy as jnp

from jax_seqpar.kernels.pallas_common import MASK_CLASSES
from jax_seqpar.kernels.pallas_mgpu_docs import (ALIGN, cta_fields, doc_blocks,
                                                 doc_tile_lists, entry_rows, max_blocks,
                                                 pack_entry)
from jax_seqpar.masks import MaskSpec


def _ids(lens, L, ids=None):
    ids = range(len(lens)) if ids is None else ids
    seg = np.concatenate([np.full(n, i, np.int32) for i, n in zip(ids, lens)])
    return np.concatenate([seg, np.full(L - len(seg), seg[-1], np.int32)])


def test_blocks_start_at_long_documents():
    lens = [300, 1100, 40, 2000, 5]  # 300 and 40 and 5 join the region before them
    T, L = sum(lens), 4096
    first, lo, hi = (np.asarray(x)[0] for x in doc_blocks(
        jnp.asarray(_ids(lens, L))[None], T, 128, anchor=1024))
    assert first.shape == (max_blocks(L, 128, 1024),)
    used = hi > lo
    got = list(zip(first[used].tolist(), lo[used].tolist(), hi[used].tolist()))
    # the region at 300 lays its blocks from 296 (a multiple of 8), owning from 300 on
    want = ([(0, 0, 128), (128, 0, 128), (256, 0, 44), (296, 4, 128)]
            + [(424 + 128 * i, 0, 128) for i in range(7)] + [(1320, 0, 120)]
            + [(1440 + 128 * i, 0, 128) for i in range(15)] + [(3360, 0, 85)])
    assert got == want
    assert (hi[~used] == 0).all() and (lo[~used] == 0).all()


@pytest.mark.parametrize("lens", [[37, 70, 13, 40], [90, 90, 2, 74]])
def test_blocks_cover_every_row_once(lens):
    T = sum(lens)
    L = -(-T // 16) * 16
    first, lo, hi = (np.asarray(x)[0] for x in doc_blocks(
        jnp.asarray(_ids(lens, L))[None], T, 16, anchor=24))
    owner = np.zeros(L, int)
    for f, a, z in zip(first, lo, hi):
        owner[f + a:f + z] += 1
        assert f % ALIGN == 0 and 0 <= a < ALIGN and a <= z <= 16
    assert (owner[:T] == 1).all() and (owner[T:] == 0).all()


def _masked(mode, mask, qpos, kpos, qseg, kseg, kend_ok):
    pos, seg = mode
    ok = np.ones((len(qpos), len(kpos)), bool)
    d = kpos[None, :] - qpos[:, None]
    if pos and mask.right_limit is not None:
        ok &= d <= mask.right_limit
    if pos and mask.left_limit is not None:
        ok &= -d <= mask.left_limit
    if seg == "pair":
        ok &= (qseg[:, None] == kseg[None, :]) & kend_ok[None, :]
    return ok


def _model(tbl, order, q, k, v, do, lse, delta, pos, seg, mask, bq, bkc):
    """What the fused kernel computes from the lists: per key block (launch order) its
    query steps, each tile's mask from its class, dQ added for every step row, dK and
    dV stored for the block's live rows only (each at most once)."""
    L, D = q.shape
    pad = lambda x, n: np.concatenate([x, np.zeros((n,) + x.shape[1:], x.dtype)])  # noqa
    qz, doz, kz, vz = pad(q, bq), pad(do, bq), pad(k, bkc), pad(v, bkc)
    lsez, dlz = np.concatenate([lse, np.full(bq, np.inf)]), pad(delta, bq)
    posq, segq = np.concatenate([pos, np.full(bq, pos[-1])]), pad(seg, bq)
    posk, segk = np.concatenate([pos, np.full(bkc, pos[-1])]), pad(seg, bkc)
    dq = np.zeros((L + bq, D))
    dk, dv = np.full((L, D), np.nan), np.full((L, D), np.nan)
    n = tbl.shape[-1]
    for cta in order:
        row = tbl[cta]
        count, n_full = row[0], row[1]
        ks, klo, khi = (int(x) for x in cta_fields(np.int32(row[n - 5]), np.int32(row[n - 4])))
        assert ks % ALIGN == 0
        bounds = [n_full, *row[n - 3:], count]
        keys = ks + np.arange(bkc)
        gk, gv = np.zeros((bkc, D)), np.zeros((bkc, D))
        for t in range(count):
            mode = None
            for i, m in enumerate(MASK_CLASSES):
                if bounds[i] <= t < bounds[i + 1]:
                    mode = m
            start, lo, hi = (int(x) for x in entry_rows(np.int32(row[t + 2])))
            assert start % ALIGN == 0
            rows = start + np.arange(bq)
            s = qz[rows] @ kz[keys].T
            lse_r = lsez[rows]
            if mode is not None:
                ok_row = (np.arange(bq) >= lo) & (np.arange(bq) < hi)
                if mode[1] == "fold":
                    ok_row &= segq[rows] == segk[ks]
                lse_r = np.where(ok_row, lse_r, np.inf)
                ok = _masked(mode, mask, posq[rows], posk[keys], segq[rows], segk[keys],
                             (keys >= ks + klo) & (keys < ks + khi))
                s = np.where(ok, s, -np.inf)
            p = np.exp(s - lse_r[:, None])
            ds = p * (doz[rows] @ vz[keys].T - dlz[rows][:, None])
            gv += p.T @ doz[rows]
            gk += ds.T @ qz[rows]
            dq[rows] += ds @ kz[keys]
        own = slice(ks + klo, ks + khi)
        assert np.isnan(dk[own]).all(), "a key row stored twice"
        dk[own], dv[own] = gk[klo:khi], gv[klo:khi]
    return dq[:L], dk, dv


@pytest.mark.parametrize("lens,window,ids", [
    ([37, 70, 13, 40], None, None),
    ([60, 3, 120, 33], 20, None), ([256], None, None), ([40, 30, 50, 21], None, [0, 1, 0, 2]),
    ([40, 6, 6, 40], None, [0, 1, 0, 1]), ([43, 40, 20], None, [0, 1, 0])])
def test_lists_give_exact_gradients(lens, window, ids):
    """The lists through the kernel's model equal the gradients of causal attention
    within documents (float64), with regions of their own and joined ones, windows,
    one long document, and an id that comes back (its queries see both runs' keys, so
    a step's rows it does not own, or a key block's, may share the other's id; there
    the positions run on over the row)."""
    rng = np.random.default_rng(len(lens) + sum(lens))
    T = sum(lens)
    L = -(-T // 32) * 32
    D = 8
    seg = _ids(lens, T, ids)
    # positions restart per document, as packing gives them
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    if ids is not None:
        pos = np.arange(T, dtype=np.int32)
    q, k, v, do = (rng.standard_normal((T, D)) for _ in range(4))
    q = q / np.sqrt(D)
    mask = MaskSpec(causal=True, window=window) if window else MaskSpec(causal=True)
    ok = _masked((True, "pair"), mask, pos, pos, seg, seg, np.ones(T, bool))
    s = np.where(ok, q @ k.T, -np.inf)
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    p = np.exp(s - lse[:, None])
    o = p @ v
    dp = do @ v.T
    delta = (do * o).sum(1)
    ds = p * (dp - delta[:, None])
    want = (ds @ k, ds.T @ q, p.T @ do)

    padi = lambda x: np.concatenate([x, np.full(L - T, x[-1], np.int32)])  # noqa: E731
    bq, bkc = 8, 16
    tbl, order = doc_tile_lists(mask, jnp.asarray(padi(pos))[None], jnp.asarray(padi(pos)),
                                jnp.asarray(padi(seg))[None], jnp.asarray(padi(seg))[None],
                                T, T, bq, bkc, anchor=24)
    tbl, order = np.asarray(tbl)[0], np.asarray(order)[0]
    assert sorted(order.tolist()) == list(range(tbl.shape[0]))
    got = _model(tbl, order, q, k, v, do, lse, delta, pos, seg, mask, bq, bkc)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-10, rtol=1e-10)
    # the lists hold fewer tiles than blocks on multiples would where documents start
    # between multiples, and every class appears in the first case
    assert tbl[:, 0].sum() > 0


def test_entry_packs_start_and_live_rows():
    e = pack_entry(np.int32(4096 * 1000 + 8), np.int32(5), np.int32(64))
    assert [int(x) for x in entry_rows(np.int32(e))] == [4096 * 1000 + 8, 5, 64]
