"""``reference_attention`` (the oracle) against ``jax.nn.dot_product_attention`` and numpy.

The numpy oracle below is float64 and builds its mask from explicit index
inequalities, independently of ``jax_seqpar.masks``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (F32, assert_close, jax_nn_fwd_bwd, make_cotangent, make_qkv,
                     reference_fwd_bwd, sorted_segments, to_np32, unsorted_segments)
from jax_seqpar import reference_attention

TOL32 = 1e-5


def np_mask(Tq, Tk, *, causal=False, window=None, q_pos=None, kv_pos=None, q_seg=None,
            kv_seg=None, B=2):
    """Boolean mask ``[B, Tq, Tk]`` from the definitions in ``jax_seqpar/masks.py``."""
    qp = np.arange(Tq) if q_pos is None else np.asarray(q_pos)
    kp = np.arange(Tk) if kv_pos is None else np.asarray(kv_pos)
    if isinstance(window, int):
        window = (window, window)
    m = np.ones((B, Tq, Tk), bool)
    for i in range(Tq):
        for j in range(Tk):
            ok = True
            if causal and kp[j] > qp[i]:
                ok = False
            if window is not None and not (qp[i] - window[0] <= kp[j] <= qp[i] + window[1]):
                ok = False
            m[:, i, j] = ok
    if q_seg is not None:
        kv_seg = q_seg if kv_seg is None else kv_seg
        m &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
    return m


def np_attention(q, k, v, mask, scale=None):
    """float64 dense attention; returns (out [B,Tq,Hq,D], lse [B,Hq,Tq])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head h -> kv head h // g
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = np.where(mask[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    has = np.isfinite(m)
    e = np.where(has, np.exp(s - np.where(has, m, 0.0)), 0.0)
    l = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(has, m + np.log(np.where(has, l, 1.0)), -np.inf)[..., 0]
    p = e / np.where(l > 0, l, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


CASES = {
    "dense": dict(),
    "causal": dict(causal=True),
    "window_5_3": dict(window=(5, 3)),
    "window_8_0_causal": dict(window=(8, 0), causal=True),
    "window_int": dict(window=4),
    "segments_sorted": dict(seg="sorted"),
    "segments_unsorted_causal": dict(seg="unsorted", causal=True),
    "gqa_4_2": dict(Hkv=2, causal=True),
    "mqa_4_1": dict(Hkv=1),
    "scale": dict(scale=0.37, window=(6, 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_jax_nn_and_numpy(name):
    c = dict(CASES[name])
    B, S, Hq = 2, 48, 4
    Hkv = c.pop("Hkv", Hq)
    seg_kind = c.pop("seg", None)
    causal, window, scale = c.get("causal", False), c.get("window"), c.get("scale")
    q, k, v = make_qkv(1, B=B, S=S, Hq=Hq, Hkv=Hkv)
    do = make_cotangent(1, q.shape)
    seg = {None: None, "sorted": sorted_segments(2, B, S),
           "unsorted": unsorted_segments(3, B, S)}[seg_kind]

    out, lse, grads = reference_fwd_bwd(q, k, v, do, seg, causal=causal, window=window,
                                        scale=scale)
    chex.assert_type([out, lse], F32)
    chex.assert_shape([out, lse], [q.shape, (B, Hq, S)])

    # jax.nn.dot_product_attention, segments as a boolean [B, 1, T, S] mask.
    jout, jgrads = jax_nn_fwd_bwd(q, k, v, do, seg, causal=causal, window=window, scale=scale)
    assert_close(out, jout, TOL32, "out vs jax.nn")
    for nm, a, b in zip("qkv", grads, jgrads):
        assert_close(a, b, TOL32, f"d{nm} vs jax.nn")

    # numpy float64 oracle, with an independently built mask: output and lse.
    m = np_mask(S, S, causal=causal, window=window,
                q_seg=None if seg is None else np.asarray(seg), B=B)
    nout, nlse = np_attention(q, k, v, m, scale)
    assert_close(out, nout, TOL32, "out vs numpy")
    assert_close(lse, nlse, TOL32, "lse vs numpy")


def test_lse_is_logsumexp_of_masked_scores():
    """lse == logsumexp over visible keys of scale * q.k, per query head (GQA)."""
    B, S, Hq, Hkv, D = 2, 40, 4, 2, 16
    q, k, v = make_qkv(4, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    seg = sorted_segments(5, B, S)

    @jax.jit
    def both(q, k, v, seg):
        _, lse = reference_attention(q, k, v, causal=True, window=(9, 0), segment_ids=seg)
        kk = jnp.repeat(k, Hq // Hkv, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, precision="highest") * D ** -0.5
        i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
        vis = (j <= i) & (j >= i - 9) & (seg[:, :, None] == seg[:, None, :])
        return lse, jax.nn.logsumexp(jnp.where(vis[:, None], s, -jnp.inf), axis=-1)

    lse, expect = both(q, k, v, seg)
    assert_close(lse, expect, TOL32, "lse")


def test_positions_are_global():
    """q_pos/kv_pos replace arange: the mask is evaluated on them, not on indices."""
    B, Tq, Tk = 2, 24, 40
    q, k, v = make_qkv(6, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=1)
    rng = np.random.default_rng(7)
    q_pos = rng.permutation(60)[:Tq].astype(np.int32)
    kv_pos = rng.permutation(60)[:Tk].astype(np.int32)
    out, lse, _ = reference_fwd_bwd(q, k, v, make_cotangent(6, q.shape), None, None,
                                    jnp.asarray(q_pos), jnp.asarray(kv_pos), causal=True,
                                    window=(20, 0))
    m = np_mask(Tq, Tk, causal=True, window=(20, 0), q_pos=q_pos, kv_pos=kv_pos, B=B)
    nout, nlse = np_attention(q, k, v, m)
    assert_close(out, nout, TOL32, "out")
    # Some rows may see no key here; those must agree too.
    np.testing.assert_array_equal(np.isneginf(to_np32(lse)), np.isneginf(nlse))
    fin = np.isfinite(nlse)
    assert_close(to_np32(lse)[fin], nlse[fin], TOL32, "lse")


def _check_fully_masked(out, lse, grads, dead):
    """``dead`` [B, Hq, Tq] marks rows with no visible key."""
    out, lse = to_np32(out), to_np32(lse)
    assert dead.any() and not dead.all(), "the test needs both dead and live rows"
    for nm, x in (("out", out), ("lse", lse)):
        assert not np.isnan(x).any(), f"{nm} has NaN"
    chex.assert_tree_all_finite(grads)
    np.testing.assert_array_equal(np.isneginf(lse), dead)
    dead_out = np.transpose(dead, (0, 2, 1))  # [B, Tq, Hq]
    assert (out[dead_out] == 0).all(), "fully masked rows must give out = 0"
    assert (np.abs(out[~dead_out]).sum(-1) > 0).all()
    assert (to_np32(grads[0])[dead_out] == 0).all(), "dq of a fully masked row is 0"


def test_fully_masked_rows_segments():
    """Queries whose segment id never occurs among the keys see nothing."""
    B, S, Hq = 2, 32, 4
    q, k, v = make_qkv(8, B=B, S=S, Hq=Hq, Hkv=2)
    do = make_cotangent(8, q.shape)
    q_seg = jnp.tile(jnp.arange(S, dtype=jnp.int32) % 3, (B, 1))
    kv_seg = jnp.tile(jnp.arange(S, dtype=jnp.int32) % 2, (B, 1))  # id 2 absent
    out, lse, grads = reference_fwd_bwd(q, k, v, do, q_seg, kv_seg)
    dead = np.broadcast_to((np.asarray(q_seg) == 2)[:, None, :], (B, Hq, S))
    _check_fully_masked(out, lse, grads, dead)
    m = np_mask(S, S, q_seg=np.asarray(q_seg), kv_seg=np.asarray(kv_seg), B=B)
    assert_close(out, np_attention(q, k, v, m)[0], TOL32, "out")


def test_fully_masked_rows_window_and_positions():
    """Causal + window with keys placed after / far before some queries."""
    B, Tq, Tk, Hq = 2, 32, 32, 4
    q, k, v = make_qkv(9, B=B, S=Tq, Sk=Tk, Hq=Hq, Hkv=4)
    do = make_cotangent(9, q.shape)
    q_pos = jnp.arange(Tq, dtype=jnp.int32)
    kv_pos = jnp.arange(Tk, dtype=jnp.int32) + 16  # queries 0..15 precede every key
    out, lse, grads = reference_fwd_bwd(q, k, v, do, None, None, q_pos, kv_pos, causal=True,
                                        window=(8, 0))
    dead = np.broadcast_to((np.arange(Tq) < 16)[None, None], (B, Hq, Tq))
    _check_fully_masked(out, lse, grads, dead)
    m = np_mask(Tq, Tk, causal=True, window=(8, 0), q_pos=np.asarray(q_pos),
                kv_pos=np.asarray(kv_pos), B=B)
    assert_close(out, np_attention(q, k, v, m)[0], TOL32, "out")


def test_reference_rejects_bad_gqa():
    q, k, v = make_qkv(0, S=8, Hq=4, Hkv=3)
    with pytest.raises(ValueError, match="Hq"):
        reference_attention(q, k, v)
