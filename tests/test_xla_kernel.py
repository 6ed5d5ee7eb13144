"""``XlaKernel`` fwd/bwd (the local-kernel contract of kernels/base.py) against the reference.

Block sizes deliberately do not divide the sequence lengths, and positions are global,
non-contiguous vectors (permutations, zigzag-like chunk pairs), as a ring step sees them.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (BF16, F32, LARGE_QK_SCALE, assert_close, assert_lse_close,
                     conditioning_tol, make_cotangent, make_large_qkv, make_qkv,
                     max_abs_score, reference_fwd_bwd, sorted_segments, to_np32, tol,
                     unsorted_segments)
from jax_seqpar.kernels import XlaKernel
from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel.merge import merge

B, T, D = 2, 100, 16
BQ, BK = 32, 24  # neither divides T


@functools.lru_cache(maxsize=None)
def kernel_fns(block_q, block_k, causal, window, scale):
    kern = XlaKernel(block_q=block_q, block_k=block_k)
    mask = MaskSpec(causal=causal, window=window)

    @jax.jit
    def fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        return kern.fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg)

    @jax.jit
    def bwd(q, k, v, o, lse, do, q_pos, kv_pos, q_seg, kv_seg, delta):
        return kern.bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg, kv_seg,
                        delta=delta)

    return fwd, bwd


def positions(kind, Tq, Tk, seed=0):
    """(q_pos, kv_pos) int32 global positions."""
    rng = np.random.default_rng(seed)
    if kind == "arange":
        qp, kp = np.arange(Tq), np.arange(Tk)
    elif kind == "perm":  # random subsets of [0, 2T) in random order, independent for q / kv
        qp = rng.permutation(Tq + Tk)[:Tq]
        kp = rng.permutation(Tq + Tk)[:Tk]
    elif kind == "zigzag":  # two chunks each, like zigzag shards of a ring step
        hq, hk = Tq // 2, Tk // 2
        qp = np.concatenate([np.arange(0, hq), np.arange(7 * hq, 7 * hq + Tq - hq)])
        kp = np.concatenate([np.arange(2 * hq, 2 * hq + hk), np.arange(5 * hq, 5 * hq + Tk - hk)])
    elif kind == "shifted":  # kv start inside the q range; window cases see partial tiles
        qp, kp = np.arange(Tq) + 30, rng.permutation(Tk)
    else:
        raise ValueError(kind)
    return jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32)


def run_case(*, Hq=4, Hkv=4, Tq=T, Tk=T, pos="arange", causal=False, window=None,
             seg=None, dtype=F32, inputs="normal", block_q=BQ, block_k=BK, seed=0,
             scale=None):
    scale = D ** -0.5 if scale is None else scale
    shape = dict(B=B, S=Tq, Sk=Tk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    if inputs == "large_int":  # exact scores up to ~1e3
        q, k, v = make_large_qkv(seed, **shape)
    else:
        q, k, v = make_qkv(seed, **shape,
                           qk_scale=LARGE_QK_SCALE if inputs == "large_normal" else 1.0)
    t = tol(dtype)
    gtol = t
    if inputs != "normal":
        big = max_abs_score(q, k, scale)
        assert 500 < big < 2000, big  # the scores really are about +-1e3
        if inputs == "large_normal":  # rounded scores: see helpers.conditioning_tol
            gtol = conditioning_tol(t, big)
    do = make_cotangent(seed, q.shape, dtype)
    q_pos, kv_pos = positions(pos, Tq, Tk, seed)
    q_seg = kv_seg = None
    if seg == "sorted":
        q_seg = kv_seg = sorted_segments(seed, B, Tq)
        assert Tq == Tk
    elif seg == "unsorted":
        q_seg, kv_seg = unsorted_segments(seed, B, Tq), unsorted_segments(seed + 1, B, Tk)
    fwd, bwd = kernel_fns(block_q, block_k, causal, window, scale)
    o, lse = fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    chex.assert_shape([o, lse], [q.shape, (B, Hq, Tq)])
    chex.assert_type([o, lse], F32)
    grads = bwd(q, k, v, o.astype(dtype), lse, do, q_pos, kv_pos, q_seg, kv_seg, None)
    ro, rlse, rgrads = reference_fwd_bwd(q, k, v, do, q_seg, kv_seg, q_pos, kv_pos,
                                         causal=causal, window=window, scale=scale)
    assert_close(o, ro, t, "o")
    assert_lse_close(lse, rlse, t)
    for nm, g, rg in zip("qkv", grads, rgrads):
        chex.assert_shape(g, rg.shape)
        chex.assert_type(g, F32)
        assert_close(g, rg, gtol, f"d{nm}")
    return dict(q=q, k=k, v=v, do=do, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
                o=o, lse=lse, grads=grads, ro=ro, rlse=rlse)


CASES = {
    "dense": dict(),
    "dense_perm_gqa": dict(pos="perm", Hkv=2),
    "causal": dict(causal=True),
    "causal_perm": dict(causal=True, pos="perm"),
    "causal_zigzag_gqa": dict(causal=True, pos="zigzag", Hkv=2),
    "causal_zigzag_cross_len": dict(causal=True, pos="zigzag", Tq=60, Hkv=1),
    "window_8_0_causal_perm": dict(causal=True, window=(8, 0), pos="perm"),
    "window_5_3_shifted": dict(window=(5, 3), pos="shifted", Hkv=2),
    "window_int_arange": dict(window=7),
    "segments_sorted": dict(seg="sorted", Hkv=2),
    "segments_unsorted_causal_mqa": dict(seg="unsorted", causal=True, pos="perm", Hkv=1),
    "bf16_causal_perm_gqa": dict(dtype=BF16, causal=True, pos="perm", Hkv=2),
    "bf16_dense": dict(dtype=BF16),
    "large_causal_perm": dict(inputs="large_int", causal=True, pos="perm"),
    "large_dense_gqa": dict(inputs="large_int", Hkv=2),
    "large_bf16_window": dict(inputs="large_int", dtype=BF16, window=(9, 4)),
    "large_normal_causal_gqa": dict(inputs="large_normal", causal=True, Hkv=2),
    "default_blocks_larger_than_T": dict(block_q=512, block_k=512, causal=True, pos="perm"),
    "tiny_blocks": dict(block_q=7, block_k=5, causal=True, window=(11, 0), Tq=40, Tk=40),
    "custom_scale": dict(scale=0.9, pos="zigzag"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    run_case(**CASES[name])


def _dead_rows(lse):
    return np.isneginf(to_np32(lse))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fully_masked_rows_causal_positions(dtype):
    """Queries that precede every key (causal) see nothing: o = 0, lse = -inf, finite grads."""
    Tq, Tk = 64, 52
    q, k, v = make_qkv(3, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=2, D=D, dtype=dtype)
    do = make_cotangent(3, q.shape, dtype)
    q_pos = jnp.arange(Tq, dtype=jnp.int32)
    kv_pos = jnp.arange(Tk, dtype=jnp.int32) + 40  # queries 0..39 are fully masked
    fwd, bwd = kernel_fns(BQ, BK, True, None, D ** -0.5)
    o, lse = fwd(q, k, v, q_pos, kv_pos, None, None)
    dq, dk, dv = bwd(q, k, v, o.astype(dtype), lse, do, q_pos, kv_pos, None, None, None)
    dead = _dead_rows(lse)
    expect_dead = np.broadcast_to(np.arange(Tq) < 40, dead.shape)
    np.testing.assert_array_equal(dead, expect_dead)
    o32 = to_np32(o)
    assert not np.isnan(o32).any() and not np.isnan(to_np32(lse)).any()
    assert (o32[:, :40] == 0).all()
    chex.assert_tree_all_finite((dq, dk, dv))
    assert (to_np32(dq)[:, :40] == 0).all()
    ro, rlse, rg = reference_fwd_bwd(q, k, v, do, None, None, q_pos, kv_pos, causal=True)
    t = tol(dtype)
    assert_close(o, ro, t, "o")
    assert_lse_close(lse, rlse, t)
    for nm, g, r in zip("qkv", (dq, dk, dv), rg):
        assert_close(g, r, t, f"d{nm}")


def test_fully_masked_rows_segments_inside_visible_tiles():
    """Rows with no key of their segment, in tiles that are computed (not skipped)."""
    Tq = Tk = 64
    q, k, v = make_qkv(4, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=1, D=D)
    do = make_cotangent(4, q.shape)
    q_pos, kv_pos = positions("perm", Tq, Tk, 4)
    q_seg = jnp.tile(jnp.arange(Tq, dtype=jnp.int32) % 3, (B, 1))
    kv_seg = jnp.tile(jnp.arange(Tk, dtype=jnp.int32) % 2, (B, 1))  # id 2 never a key
    fwd, bwd = kernel_fns(BQ, BK, False, None, D ** -0.5)  # dense: every tile computed
    o, lse = fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    grads = bwd(q, k, v, o, lse, do, q_pos, kv_pos, q_seg, kv_seg, None)
    ro, rlse, rg = reference_fwd_bwd(q, k, v, do, q_seg, kv_seg, q_pos, kv_pos)
    dead = np.broadcast_to((np.asarray(q_seg) == 2)[:, None], lse.shape)
    np.testing.assert_array_equal(_dead_rows(lse), dead)
    chex.assert_tree_all_finite(grads)
    assert (to_np32(o)[np.transpose(dead, (0, 2, 1))] == 0).all()
    assert_close(o, ro, 1e-5, "o")
    assert_lse_close(lse, rlse, 1e-5)
    for nm, g, r in zip("qkv", grads, rg):
        assert_close(g, r, 1e-5, f"d{nm}")


# ------------------------------------------------------------------ tile skipping
def test_causal_and_window_masks_use_cond_dense_does_not():
    q, k, v = make_qkv(0, B=1, S=16, Hq=2, Hkv=2, D=D)
    pos = jnp.arange(16, dtype=jnp.int32)

    def jaxpr(mask):
        f = lambda q, k, v: XlaKernel(8, 8).fwd(q, k, v, pos, pos, mask, 0.25)  # noqa: E731
        return str(jax.make_jaxpr(f)(q, k, v))

    assert "cond" in jaxpr(MaskSpec(causal=True))
    assert "cond" in jaxpr(MaskSpec(window=(3, 3)))
    assert "cond" not in jaxpr(MaskSpec())


@pytest.mark.parametrize("causal,window,q_range,poison", [
    # causal: keys 48..95 come after every query 0..47
    (True, None, (0, 48), (48, 96)),
    # causal window (8, 0): queries 64..111 never see keys 0..47 (nor 112..)
    (True, (8, 0), (64, 112), (0, 48)),
    # two-sided window (4, 2): queries 64..111 never see keys 0..47
    (False, (4, 2), (64, 112), (0, 48)),
])
@pytest.mark.parametrize("block_q", [48, 16])
def test_fully_masked_tiles_are_never_computed(causal, window, q_range, poison, block_q):
    """NaN in K/V rows of tiles whose positions prove them fully masked must not leak.

    With block_k=24 the poisoned rows fill whole key blocks; a kernel that computed those
    tiles would produce NaN (0 * NaN) in o and in every gradient.
    """
    Tk = 120
    Tq = q_range[1] - q_range[0]
    q, k, v = make_qkv(5, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=2, D=D)
    do = make_cotangent(5, q.shape)
    q_pos = jnp.arange(*q_range, dtype=jnp.int32)
    kv_pos = jnp.arange(Tk, dtype=jnp.int32)
    bad = (jnp.arange(Tk) >= poison[0]) & (jnp.arange(Tk) < poison[1])
    kn = jnp.where(bad[None, :, None, None], jnp.nan, k)
    vn = jnp.where(bad[None, :, None, None], jnp.nan, v)
    scale = D ** -0.5
    fwd, bwd = kernel_fns(block_q, 24, causal, window, scale)
    o, lse = fwd(q, kn, vn, q_pos, kv_pos, None, None)
    dq, dk, dv = bwd(q, kn, vn, o, lse, do, q_pos, kv_pos, None, None, None)
    chex.assert_tree_all_finite((o, lse, dq))
    # Gradients of the skipped keys are exactly zero, the others finite.
    for nm, g in (("dk", dk), ("dv", dv)):
        g = to_np32(g)
        assert (g[:, np.asarray(bad)] == 0).all(), nm
        assert np.isfinite(g[:, ~np.asarray(bad)]).all(), nm
    # And the values are those of attention without the poisoned keys.
    ro, rlse, (rdq, rdk, rdv) = reference_fwd_bwd(q, k, v, do, None, None, q_pos, kv_pos,
                                                  causal=causal, window=window)
    assert_close(o, ro, 1e-5, "o")
    assert_lse_close(lse, rlse, 1e-5)
    assert_close(dq, rdq, 1e-5, "dq")
    keep = ~np.asarray(bad)
    assert_close(to_np32(dk)[:, keep], to_np32(rdk)[:, keep], 1e-5, "dk")
    assert_close(to_np32(dv)[:, keep], to_np32(rdv)[:, keep], 1e-5, "dv")


# ------------------------------------------------------------------ bwd contract details
def test_precomputed_delta_gives_same_grads_and_is_used():
    r = run_case(causal=True, pos="perm", Hkv=2, seed=6)
    scale = D ** -0.5
    _, bwd = kernel_fns(BQ, BK, True, None, scale)
    args = (r["q"], r["k"], r["v"], r["o"], r["lse"], r["do"], r["q_pos"], r["kv_pos"],
            None, None)
    delta = attention_delta(r["o"], r["do"])
    chex.assert_shape(delta, (B, 4, T))
    chex.assert_type(delta, F32)
    expect = np.einsum("bqhd,bqhd->bhq", to_np32(r["do"]), to_np32(r["o"]))
    assert_close(delta, expect, 1e-6, "delta")
    with_delta = bwd(*args, delta)
    for nm, a, b in zip("qkv", with_delta, r["grads"]):
        assert_close(a, b, 1e-6, f"d{nm} with delta")
    # With delta given, o is not needed (the BurstAttention ring passes o=None).
    no_o = bwd(*args[:3], None, *args[4:], delta)
    for nm, a, b in zip("qkv", no_o, r["grads"]):
        assert_close(a, b, 1e-6, f"d{nm} with delta and o=None")
    # A wrong delta must change dq/dk (so the argument is really used, not recomputed).
    wrong = bwd(*args, delta + 1.0)
    assert rel_err_gt(wrong[0], r["grads"][0], 1e-2)
    assert rel_err_gt(wrong[1], r["grads"][1], 1e-2)


def rel_err_gt(a, b, thresh):
    a, b = to_np32(a), to_np32(b)
    return np.linalg.norm(a - b) / np.linalg.norm(b) > thresh


@pytest.mark.parametrize("causal", [False, True])
def test_bwd_with_global_o_lse_splits_over_key_blocks(causal):
    """bwd on a key subset with the *global* (o, lse) gives that subset's share of the
    gradient: dq sums over subsets, dk/dv are the subsets' rows (how the ring uses it)."""
    Tk = T
    q, k, v = make_qkv(7, B=B, S=T, Sk=Tk, Hq=4, Hkv=2, D=D)
    do = make_cotangent(7, q.shape)
    q_pos, kv_pos = positions("perm", T, Tk, 7)
    scale = D ** -0.5
    fwd, bwd = kernel_fns(BQ, BK, causal, None, scale)
    o, lse = fwd(q, k, v, q_pos, kv_pos, None, None)
    split = 37
    parts = [slice(0, split), slice(split, Tk)]
    dq = 0
    dks, dvs = [], []
    for sl in parts:
        gq, gk, gv = bwd(q, k[:, sl], v[:, sl], o, lse, do, q_pos, kv_pos[sl], None, None, None)
        dq = dq + gq
        dks.append(gk)
        dvs.append(gv)
    _, _, (rdq, rdk, rdv) = reference_fwd_bwd(q, k, v, do, None, None, q_pos, kv_pos,
                                              causal=causal)
    assert_close(dq, rdq, 1e-5, "dq")
    assert_close(jnp.concatenate(dks, 1), rdk, 1e-5, "dk")
    assert_close(jnp.concatenate(dvs, 1), rdv, 1e-5, "dv")


def test_merge_of_partial_results_including_empty_parts():
    """fwd over disjoint key subsets + merge == fwd over all keys, also when a subset
    hides every key from some rows (lse = -inf), and when both subsets do."""
    Tq, Tk = 48, 72
    q, k, v = make_qkv(8, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=2, D=D)
    q_pos = jnp.arange(Tq, dtype=jnp.int32) + 20  # queries 20..67
    kv_pos = jnp.arange(Tk, dtype=jnp.int32) + 30  # keys 30..101: queries 20..29 see none
    scale = D ** -0.5
    fwd, _ = kernel_fns(BQ, BK, True, None, scale)
    oa, la = fwd(q, k[:, :25], v[:, :25], q_pos, kv_pos[:25], None, None)
    ob, lb = fwd(q, k[:, 25:], v[:, 25:], q_pos, kv_pos[25:], None, None)
    assert np.isneginf(to_np32(lb)).any()  # part b hides every key from some rows
    o, lse = jax.jit(merge)(oa, la, ob, lb)
    ro, rlse, _ = reference_fwd_bwd(q, k, v, make_cotangent(8, q.shape), None, None, q_pos,
                                    kv_pos, causal=True)
    dead = np.isneginf(to_np32(rlse))
    assert dead.any()
    assert not np.isnan(to_np32(o)).any()
    assert (to_np32(o)[np.transpose(dead, (0, 2, 1))] == 0).all()
    assert_close(o, ro, 1e-5, "merged o")
    assert_lse_close(lse, rlse, 1e-5, "merged lse")
