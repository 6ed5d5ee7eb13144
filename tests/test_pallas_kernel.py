"""``PallasKernel`` (kernels/pallas_gpu*.py) in interpret mode on CPU, against the reference.

The kernels run with tiles of 16 so that every case has several query and key blocks,
with sequence lengths that are not multiples of the tile, and with position vectors as
a ring step, a zigzag shard or a striped shard produces them.  The GPU-compiled path is
exercised by ``benchmarks/kernels.py`` (results in benchmarks/RESULTS.md).
"""

import collections
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar as jsp
from helpers import (BF16, F32, assert_close, assert_lse_close, make_cotangent, make_mesh,
                     make_qkv, reference_fwd_bwd, sorted_segments, to_np32, tol,
                     unsorted_segments)
from jax_seqpar.kernels import PallasConfig, PallasKernel, XlaKernel, get_kernel
from jax_seqpar.kernels.base import KernelRequest
from jax_seqpar.kernels.pallas_gpu import (DEFAULT_CONFIGS, default_config,
                                           forward_smem_bytes, tile_lists)
from jax_seqpar.layouts import shard_positions
from jax_seqpar.masks import BlockMask, MaskSpec

F16 = jnp.float16
SMALL = PallasConfig(block_q=16, block_k=16, num_warps=4, num_stages=2, block_q_bwd=16,
                     block_k_bwd=16, num_warps_bwd=4)
KERNEL = PallasKernel(config=SMALL)
D = 64  # the smallest head dim the kernel accepts


def _tol(dtype):
    return 2e-2 if jnp.dtype(dtype) != jnp.dtype(F32) else tol(F32)


def positions(kind, Tq, Tk):
    """(q_pos, kv_pos) int32 as one ring step / layout would hand them to the kernel."""
    if kind == "contiguous":
        return np.arange(Tq) + max(Tk - Tq, 0), np.arange(Tk)
    if kind == "ring_step":  # queries of device 3, keys of device 1 (all visible, causal)
        return 3 * Tk + np.arange(Tq), Tk + np.arange(Tk)
    if kind == "masked_rows":  # causal: the first 20 queries precede every key
        return 80 + np.arange(Tq), 100 + np.arange(Tk)
    G = 4  # zigzag / striped: device 2's queries against device 1's keys
    return (shard_positions(kind, 2, Tq, G, xp=np), shard_positions(kind, 1, Tk, G, xp=np))


@functools.lru_cache(maxsize=None)
def fns(causal, window):
    mask = MaskSpec(causal=causal, window=window)

    @jax.jit
    def run(q, k, v, do, q_pos, kv_pos, q_seg, kv_seg):
        o, lse = KERNEL.fwd(q, k, v, q_pos, kv_pos, mask, D ** -0.5, q_seg, kv_seg)
        grads = KERNEL.bwd(q, k, v, o.astype(q.dtype), lse, do, q_pos, kv_pos, mask,
                           D ** -0.5, q_seg, kv_seg)
        return o, lse, grads
    return run


CASES = {
    # name: (Tq, Tk, Hq, Hkv, positions, causal, window, segments, dtype)
    "dense_ragged_f32": (40, 56, 2, 2, "contiguous", False, None, False, F32),
    "causal_gqa_f32": (48, 48, 4, 2, "contiguous", True, None, False, F32),
    "causal_mqa_bf16": (48, 40, 4, 1, "contiguous", True, None, False, BF16),
    "ring_step_f16": (32, 32, 2, 2, "ring_step", True, None, False, F16),
    "zigzag_causal_gqa_f32": (32, 32, 4, 2, "zigzag", True, None, False, F32),
    "striped_causal_bf16": (32, 32, 2, 2, "striped", True, None, False, BF16),
    "window_segments_f32": (48, 48, 4, 2, "contiguous", False, (9, 4), True, F32),
    "causal_window_segments_bf16": (40, 40, 2, 1, "contiguous", True, (12, 0), True, BF16),
    "masked_rows_f32": (32, 32, 2, 2, "masked_rows", True, None, False, F32),
    # issue 27: many short documents (tiles skipped and run mask-free by segment ranges),
    # on a zigzag shard pair and with interleaved (unsorted) ids
    "zigzag_short_docs_bf16": (64, 64, 2, 1, "zigzag", True, None, "short", BF16),
    "unsorted_segments_f32": (40, 48, 2, 2, "contiguous", True, None, "unsorted", F32),
}


def _segments(kind, seed, B, T):
    if not kind:
        return None
    if kind == "short":
        return sorted_segments(seed, B, T, num_docs=T // 6)
    if kind == "unsorted":
        return unsorted_segments(seed, B, T, num_ids=3)
    return sorted_segments(seed, B, T, num_docs=3)


@pytest.mark.parametrize("case", list(CASES))
def test_fwd_bwd_against_reference(case):
    Tq, Tk, Hq, Hkv, pos, causal, window, seg, dtype = CASES[case]
    B = 2
    q, k, v = make_qkv(3, B=B, S=Tq, Sk=Tk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    do = make_cotangent(3, q.shape, dtype)
    qp, kp = (jnp.asarray(x, jnp.int32) for x in positions(pos, Tq, Tk))
    qs, ks = _segments(seg, 4, B, Tq), _segments(seg, 5, B, Tk)
    o, lse, grads = fns(causal, window)(q, k, v, do, qp, kp, qs, ks)
    ro, rlse, rgrads = reference_fwd_bwd(q, k, v, do, qs, ks, qp, kp, causal=causal,
                                         window=window, scale=D ** -0.5)
    t = _tol(dtype)
    chex.assert_type([o, lse], F32)
    chex.assert_shape(lse, (B, Hq, Tq))
    assert_close(o, ro, t, "out")
    assert_lse_close(lse, rlse, t)
    for name, g, r in zip("qkv", grads, rgrads):
        assert_close(g, r, t, f"d{name}")
    if pos == "masked_rows":  # rows that see nothing: o = 0, lse = -inf, dq = 0, no NaN
        assert np.isneginf(to_np32(lse)[:, :, :20]).all()
        assert (to_np32(o)[:, :20] == 0).all() and (to_np32(grads[0])[:, :20] == 0).all()


def test_per_row_query_positions_and_external_lse():
    """``q_pos`` ``[B, Tq]`` (decoding with ragged lengths) and a backward fed the lse of a
    larger attention plus a precomputed delta, as the ring does."""
    B, Tq, Tk = 2, 4, 48
    q, k, v = make_qkv(6, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=1, D=D)
    do = make_cotangent(6, q.shape)
    qp = jnp.asarray([[44, 45, 46, 47], [20, 21, 22, 23]], jnp.int32)
    kp = jnp.arange(Tk, dtype=jnp.int32)
    mask = MaskSpec(causal=True)
    half = Tk // 2

    @jax.jit  # one program for every call below
    def run(q, k, v, do, qp, kp):
        o, lse = KERNEL.fwd(q, k, v, qp, kp, mask, 0.1)
        xo, xlse = XlaKernel(block_q=8, block_k=8).fwd(q, k, v, qp, kp, mask, 0.1)
        full = KERNEL.bwd(q, k, v, o, lse, do, qp, kp, mask, 0.1)
        # keys split in two halves: each half's backward with the *global* lse (and a
        # precomputed delta) sums to the whole
        parts = [KERNEL.bwd(q, k[:, s], v[:, s], o, lse, do, qp, kp[s], mask, 0.1,
                            delta=jnp.einsum("bqhd,bqhd->bhq", do, o))
                 for s in (slice(0, half), slice(half, Tk))]
        return o, lse, xo, xlse, full, parts

    o, lse, xo, xlse, full, parts = run(q, k, v, do, qp, kp)
    assert_close(o, xo, 1e-5, "out vs xla")
    assert_lse_close(lse, xlse, 1e-5)
    assert_close(parts[0][0] + parts[1][0], full[0], 1e-5, "dq split over key halves")
    assert_close(jnp.concatenate([parts[0][1], parts[1][1]], 1), full[1], 1e-5, "dk halves")


@pytest.mark.parametrize("strategy,layout", [("ring", "zigzag"), ("ring", "striped"),
                                             ("tree", "contiguous"), ("allgather", "zigzag")])
def test_parallel_strategies_with_pallas_match_reference(strategy, layout):
    """Issue 6: the ring (and tree, all-gather) with ``kernel="pallas"`` computes attention
    and its gradients within the float32 budget of the dense reference (as ``"xla"`` does:
    tests/test_attention.py, tests/test_layouts.py)."""
    mesh = make_mesh(4)
    q, k, v = make_qkv(8, B=1, S=128, Hq=4, Hkv=2, D=D)
    do = make_cotangent(8, q.shape)
    seg = sorted_segments(8, 1, 128, num_docs=3)

    @jax.jit
    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: jsp.attention(
            q, k, v, mesh=mesh, strategy=strategy, layout=layout, causal=True,
            segment_ids=seg, kernel=KERNEL), q, k, v)
        return o, vjp(do)

    o, g = fwd_bwd(q, k, v, do)
    ro, _, rg = reference_fwd_bwd(q, k, v, do, seg, causal=True)
    assert_close(o, ro, 1e-5, "out pallas vs reference")
    for name, a, b in zip("qkv", g, rg):
        assert_close(a, b, 1e-5, f"d{name} pallas vs reference")


def test_tree_decode_with_pallas():
    mesh = make_mesh(4)
    q, _, _ = make_qkv(9, B=2, S=4, Hq=4, Hkv=1, D=D)
    _, k, v = make_qkv(10, B=2, S=128, Hq=4, Hkv=1, D=D)
    lens = jnp.asarray([128, 50])
    out = jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=lens, causal=True, kernel=KERNEL)
    ref = jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=lens, causal=True, kernel="xla")
    assert_close(out, ref, 1e-5, "tree_decode pallas vs xla")


# ------------------------------------------------------------------------- tile lists
@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped", "ring_step"])
@pytest.mark.parametrize("mask", [MaskSpec(causal=True), MaskSpec(window=(20, 3)),
                                  MaskSpec(causal=True, window=(30, 0))], ids=str)
def test_tile_lists_match_brute_force(kind, mask):
    """Counts and the "fully visible first" order against pair-by-pair visibility."""
    Tq, Tk, bq, bk = 64, 50, 16, 8
    qp, kp = positions(kind, Tq, Tk)
    Lk = -(-Tk // bk) * bk
    kp_pad = np.concatenate([kp, np.full(Lk - Tk, kp[-1])]).astype(np.int32)
    tbl = np.asarray(tile_lists(mask, jnp.asarray(qp[None], jnp.int32), jnp.asarray(kp_pad),
                                Tk, bq, bk, has_seg=False))
    vis = np.asarray(mask.visible(jnp.asarray(qp), jnp.asarray(kp)))  # [Tq, Tk]
    vis = np.pad(vis, ((0, 0), (0, Lk - Tk)))
    for i in range(Tq // bq):
        tiles = vis[i * bq:(i + 1) * bq].reshape(bq, Lk // bk, bk)
        any_vis = tiles.any(axis=(0, 2))
        all_vis = tiles.all(axis=(0, 2))
        count, n_full, blocks = tbl[0, i, 0], tbl[0, i, 1], tbl[0, i, 2:]
        listed = set(blocks[:count].tolist())
        assert set(np.flatnonzero(any_vis)) <= listed, "a visible tile was dropped"
        assert set(blocks[:n_full].tolist()) <= set(np.flatnonzero(all_vis)), \
            "a tile marked fully visible has a masked pair"
        assert len(listed) == count, "a tile is listed twice"


def test_compact_tiles_is_a_stable_partition():
    """The lists' order without a sort equals a stable argsort by (full, partial,
    invisible), zeros past the visible count."""
    from jax_seqpar.kernels.pallas_common import compact_tiles
    rng = np.random.default_rng(0)
    vis = rng.random((3, 9, 17)) < 0.5
    full = vis & (rng.random(vis.shape) < 0.5)
    order, count, n_full = (np.asarray(x) for x in compact_tiles(jnp.asarray(vis),
                                                                jnp.asarray(full)))
    want = np.argsort(np.where(full, 0, np.where(vis, 1, 2)), axis=-1, kind="stable")
    want = np.where(np.arange(17) < vis.sum(-1)[..., None], want, 0)
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(count, vis.sum(-1))
    np.testing.assert_array_equal(n_full, full.sum(-1))


def test_partition_tiles_is_a_stable_sort_by_group():
    """With five groups (``tile_lists(classes=True)``'s) the one-pass partition equals a
    stable argsort by group with the invisible columns last, zeros past the count."""
    from jax_seqpar.kernels.pallas_common import partition_tiles
    rng = np.random.default_rng(1)
    vis = rng.random((2, 7, 23)) < 0.6
    group = rng.integers(0, 5, vis.shape)
    order, counts = (np.asarray(x) for x in partition_tiles(jnp.asarray(vis),
                                                            jnp.asarray(group), 5))
    want = np.argsort(np.where(vis, group, 5), axis=-1, kind="stable")
    want = np.where(np.arange(23) < vis.sum(-1)[..., None], want, 0)
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(counts, np.stack([(vis & (group == g)).sum(-1)
                                                    for g in range(5)], -1))


def _padded_blocks(x, b):
    L = -(-len(x) // b) * b
    return np.concatenate([x, np.full(L - len(x), x[-1])]).astype(np.int32)


def _segment_case(kind, segs, Tq, Tk, seed):
    """Positions of a ``kind`` shard and segment ids read from one global array at them:
    ``"unsorted"`` ids in 0..2, else sorted ids with 4 (``"sorted"``), ``S // 5``
    (``"short"``) or 1 (``"single"``) documents.  ``(qp, kp, q_ids, kv_ids)``."""
    qp, kp = positions(kind, Tq, Tk)
    S = int(max(qp.max(), kp.max())) + 1
    rng = np.random.default_rng(seed)
    if segs == "unsorted":
        glob = rng.integers(0, 3, S)
    else:
        n = {"sorted": 4, "short": S // 5, "single": 1}[segs]
        glob = np.zeros(S, int)
        for c in rng.choice(np.arange(1, S), n - 1, replace=False):
            glob[c:] += 1
    return qp, kp, glob[qp], glob[kp]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped", "ring_step"])
@pytest.mark.parametrize("segs", ["sorted", "short", "unsorted", "single"])
def test_tile_lists_with_segments_match_brute_force(kind, segs):
    """Issue 27: with segment ids the lists drop only tiles whose pairs are all masked
    (by positions or by segments: the blocks' id ranges are disjoint) and mark fully
    visible only tiles whose every pair is visible, for sorted, short and interleaved
    ids; with sorted ids they skip tiles that positions alone would keep."""
    Tq, Tk, bq, bk = 64, 50, 16, 8
    qp, kp, qs, ks = _segment_case(kind, segs, Tq, Tk, len(kind) + len(segs))
    mask = MaskSpec(causal=True)
    kp_pad, qs_pad, ks_pad = _padded_blocks(kp, bk), _padded_blocks(qs, bq), \
        _padded_blocks(ks, bk)
    Lk = len(kp_pad)

    def lists(has_seg=True, **kw):
        return np.asarray(tile_lists(mask, jnp.asarray(qp[None], jnp.int32),
                                     jnp.asarray(kp_pad), Tk, bq, bk, has_seg, **kw))
    tbl = lists(q_seg=jnp.asarray(qs_pad[None]), kv_seg=jnp.asarray(ks_pad[None]))
    plain = lists()
    vis = np.asarray(mask.visible(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(qs),
                                  jnp.asarray(ks)))
    vis = np.pad(vis, ((0, 0), (0, Lk - Tk)))
    for i in range(Tq // bq):
        tiles = vis[i * bq:(i + 1) * bq].reshape(bq, Lk // bk, bk)
        count, n_full, blocks = tbl[0, i, 0], tbl[0, i, 1], tbl[0, i, 2:]
        listed = set(blocks[:count].tolist())
        assert set(np.flatnonzero(tiles.any(axis=(0, 2)))) <= listed, "a visible tile dropped"
        assert set(blocks[:n_full].tolist()) <= set(np.flatnonzero(tiles.all(axis=(0, 2)))), \
            "a tile marked fully visible has a masked pair"
        assert len(listed) == count <= plain[0, i, 0]
        assert plain[0, i, 1] == 0  # without the ranges, segments make nothing full
    if segs == "short" and kind != "striped":  # many documents: tiles are skipped
        assert tbl[0, :, 0].sum() < plain[0, :, 0].sum()
    if segs == "single":  # one document: the lists of a call without segment ids
        np.testing.assert_array_equal(tbl, lists(has_seg=False))


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "ring_step"])
@pytest.mark.parametrize("segs", ["sorted", "short", "unsorted"])
@pytest.mark.parametrize("transpose", [False, True], ids=["rows_q", "rows_k"])
def test_tile_lists_mask_classes_rebuild_the_mask(kind, segs, transpose):
    """``tile_lists(classes=True)`` (the Hopper backward's ``mask_classes``): the same
    tiles and fully visible ones as without classes, the partial ones sorted into
    ``MASK_CLASSES``; on every tile of a class, the tests that class runs (positions or
    not; segments per pair, or folded: the query's id against the key block's one id)
    give exactly the mask of the contract, padded keys included."""
    from jax_seqpar.kernels.pallas_common import MASK_CLASSES
    Tq, Tk, bq, bk = 64, 50, 16, 8
    qp, kp, qs, ks = _segment_case(kind, segs, Tq, Tk, len(kind) + 7 * len(segs))
    mask = MaskSpec(causal=True)
    kp_pad, qs_pad, ks_pad = _padded_blocks(kp, bk), _padded_blocks(qs, bq), \
        _padded_blocks(ks, bk)
    Lk = len(kp_pad)

    def lists(**kw):
        return np.asarray(tile_lists(mask, jnp.asarray(qp[None], jnp.int32),
                                     jnp.asarray(kp_pad), Tk, bq, bk, True,
                                     transpose=transpose, q_seg=jnp.asarray(qs_pad[None]),
                                     kv_seg=jnp.asarray(ks_pad[None]), **kw))
    plain, tbl = lists(), lists(classes=True)
    n_cols = plain.shape[-1] - 2
    assert tbl.shape[-1] == n_cols + 5
    np.testing.assert_array_equal(tbl[..., :2], plain[..., :2])
    pad = np.arange(Lk) < Tk
    pos_vis = np.asarray(mask.visible(jnp.asarray(qp), jnp.asarray(kp_pad))) & pad
    seg_eq = qs[:, None] == ks_pad[None, :]
    vis = pos_vis & seg_eq
    seen = collections.Counter()
    for r in range(tbl.shape[1]):
        count, n_full = tbl[0, r, 0], tbl[0, r, 1]
        blocks = tbl[0, r, 2:2 + count]
        assert set(blocks.tolist()) == set(plain[0, r, 2:2 + count].tolist())
        assert set(blocks[:n_full].tolist()) == set(plain[0, r, 2:2 + n_full].tolist())
        bounds = [n_full, *tbl[0, r, -3:], count]
        assert all(a <= b for a, b in zip(bounds, bounds[1:])), bounds
        for c, (pos, seg) in enumerate(MASK_CLASSES):
            for col in blocks[bounds[c]:bounds[c + 1]]:
                i, j = (col, r) if transpose else (r, col)
                rows, keys = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
                got = pos_vis[rows, keys] if pos else np.ones((bq, bk), bool)
                if not pos:  # the positions prove every pair visible, no padded key
                    assert pos_vis[rows, keys].all()
                if seg == "fold":
                    kblock = ks_pad[keys]
                    assert (kblock == kblock[0]).all(), "a folded tile's keys span documents"
                    got = got & (qs[rows] == kblock[0])[:, None]
                else:
                    got = got & seg_eq[rows, keys]
                np.testing.assert_array_equal(got, vis[rows, keys])
                seen[(pos, seg)] += 1
    if segs == "sorted" and kind == "contiguous":  # every class occurs on packed ids
        assert set(seen) == set(MASK_CLASSES), seen
    with pytest.raises(ValueError, match=r"classes=True\) needs q_seg"):
        tile_lists(mask, jnp.asarray(qp[None], jnp.int32), jnp.asarray(kp_pad), Tk, bq, bk,
                   True, classes=True)


def test_segment_skip_flag_restores_the_plain_lists():
    """``PallasConfig(segment_skip=False)`` / ``MgpuConfig(segment_skip=False)``: the
    fallback that lists every position-visible tile."""
    from jax_seqpar.kernels.pallas_common import segment_lists_args
    seg = jnp.zeros((1, 32), jnp.int32)
    assert segment_lists_args(seg, seg, False) == {}
    assert set(segment_lists_args(seg, seg, True)) == {"q_seg", "kv_seg"}
    assert segment_lists_args(None, None, True) == {}
    assert not PallasConfig(segment_skip=False).segment_skip
    with pytest.raises(ValueError, match="segment_skip"):
        PallasConfig(segment_skip=1)


def test_tile_lists_skip_tiles_for_causal():
    """Causal contiguous: query block i lists exactly blocks 0..i, all but the diagonal full."""
    pos = jnp.arange(64, dtype=jnp.int32)
    tbl = np.asarray(tile_lists(MaskSpec(causal=True), pos[None], pos, 64, 16, 16, False))
    for i in range(4):
        assert tbl[0, i, 0] == i + 1 and tbl[0, i, 1] == i
        assert list(tbl[0, i, 2:2 + i + 1]) == list(range(i)) + [i]


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw,pattern", [
    (dict(block_q=48), "power of two"), (dict(block_k=8), ">= 16"),
    (dict(num_warps=3), "power of two"), (dict(num_stages=0), "positive"),
])
def test_config_validation(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        PallasConfig(**kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_fit_hopper_shared_memory(head_dim, dtype):
    # H100/H200: 227 KiB of shared memory per block; float32 tiles take twice the bytes
    cfg = default_config(head_dim, dtype)
    assert forward_smem_bytes(cfg, head_dim, dtype) <= 227 * 1024
    if dtype != "float32":
        assert cfg == DEFAULT_CONFIGS[head_dim]  # the measured defaults


def test_config_type_checked():
    with pytest.raises(TypeError, match="config"):
        PallasKernel(config={"block_q": 64})


@pytest.mark.parametrize("request_kw,pattern", [
    (dict(head_dim=32), "head_dim=32"),
    (dict(dtype="float64"), "dtype float64"),
    (dict(mask=MaskSpec(block_mask=BlockMask(np.eye(4, dtype=bool), 16))), "block_mask"),
])
def test_refuses_what_it_cannot_do(request_kw, pattern):
    req = dict(platform="gpu", dtype="bfloat16", head_dim=128, mask=MaskSpec())
    req.update(request_kw)
    with pytest.raises(NotImplementedError, match=pattern):
        get_kernel("pallas", KernelRequest(**req))


def test_auto_falls_back_to_xla_for_block_masks_on_gpu():
    mask = MaskSpec(block_mask=BlockMask(np.eye(4, dtype=bool), 16))
    kern = get_kernel("auto", KernelRequest(platform="gpu", dtype="bfloat16", head_dim=128,
                                            mask=mask))
    assert kern.name == "xla"
    assert get_kernel("auto", KernelRequest(platform="gpu", dtype="bfloat16", head_dim=128,
                                            mask=MaskSpec())).name == "pallas"


def test_auto_on_cpu_is_xla_and_pallas_by_name_interprets():
    req = KernelRequest(platform="cpu", dtype="float32", head_dim=64, mask=MaskSpec())
    assert get_kernel("auto", req).name == "xla"  # interpret mode is for tests only
    kern = get_kernel("pallas", req)
    assert kern.name == "pallas" and kern._interpret()


@pytest.mark.parametrize("kern", [KERNEL, XlaKernel()], ids=["pallas", "xla"])
@pytest.mark.parametrize("causal", [True, False])
def test_scores_below_the_exp_range_on_ragged_keys(kern, causal):
    """Scores around -512 (lse far below -88, where ``exp`` of a padded key's
    ``0 - lse`` would overflow) with keys not a multiple of the tile: the gradients are
    finite and the reference's.  The Hopper backward once put NaN there
    (``benchmarks/pad_keys_probe.py`` checks it on a GPU); these kernels run here."""
    T, H = 40, 2
    rng = np.random.default_rng(3)
    u = np.sign(rng.standard_normal((1, 1, H, D)))
    # scores -512 plus a spread of a few units (identical keys would make dQ 0)
    q = jnp.asarray(np.broadcast_to(8 * u, (1, T, H, D)), F32)
    k = jnp.asarray(-8 * u + 0.5 * rng.standard_normal((1, T, H, D)), F32)
    _, _, v = make_qkv(5, B=1, S=T, Hq=H, Hkv=H, D=D)
    do = make_cotangent(6, (1, T, H, D))
    pos = jnp.arange(T, dtype=jnp.int32)
    mask, scale = MaskSpec(causal=causal), D ** -0.5
    o, lse = kern.fwd(q, k, v, pos, pos, mask, scale)
    grads = kern.bwd(q, k, v, o, lse, do, pos, pos, mask, scale)
    ro, rlse, rgrads = reference_fwd_bwd(q, k, v, do, causal=causal, scale=scale)
    assert float(jnp.max(rlse)) < -400
    # float32 scores of magnitude ~740 (log2 units) round by ~740 * 2**-24 = 4.4e-5 before
    # exp2, relative error that P carries: a budget of 1e-4 instead of tol(F32)
    assert_lse_close(lse, rlse, tol(F32))
    for name, g, r in zip("qkv", grads, rgrads):
        assert_close(g, r, 1e-4, what=f"d{name}")
