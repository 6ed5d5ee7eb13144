"""The flash-attn-jax adapter (kernels/flash_attn.py), against a stand-in module.

flash-attn-jax needs a CUDA GPU, so here a stand-in with the same two functions and
FlashAttention-2's mask convention (written from its documentation, in jnp) is installed
as ``flash_attn_jax.flash_fwd`` / ``flash_bwd`` (the 0.6.x layout).  This checks the adapter's translation -- positions to window
sides, lse layout, dtypes, what it refuses -- not the CUDA kernels themselves, which
``benchmarks/kernels.py`` compares with the reference on a GPU when the package is present.
"""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BF16, assert_close, make_cotangent, make_qkv, reference_fwd_bwd
from jax_seqpar.kernels import FlashAttnKernel, get_kernel
from jax_seqpar.kernels.base import KernelRequest
from jax_seqpar.kernels.flash_attn import flash_window
from jax_seqpar.masks import MaskSpec

D = 32


def _band(Tq, Tk, window):
    """FlashAttention-2: row i sees j in [i + Tk - Tq - left, i + Tk - Tq + right]."""
    left, right = window
    i, j = np.arange(Tq)[:, None], np.arange(Tk)[None, :]
    c = i + Tk - Tq
    ok = np.ones((Tq, Tk), bool)
    if left >= 0:
        ok &= j >= c - left
    if right >= 0:
        ok &= j <= c + right
    return jnp.asarray(ok)


_STATIC = ("softmax_scale", "is_causal", "window_size_left", "window_size_right")


@functools.partial(jax.jit, static_argnames=_STATIC)  # one program per case, not per op
def _stand_in_fwd(q, k, v, *, softmax_scale, is_causal, window_size_left, window_size_right):
    assert not is_causal and q.dtype in (jnp.bfloat16, jnp.float16)
    window_size = (window_size_left, window_size_right)
    g = q.shape[2] // k.shape[2]
    kk, vv = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk) * softmax_scale
    s = jnp.where(_band(q.shape[1], k.shape[1], window_size), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), vv)
    return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=_STATIC)
def _stand_in_bwd(dout, q, k, v, out, lse, *, softmax_scale, is_causal, window_size_left,
                  window_size_right):
    """FlashAttention-2's backward from the *given* out and lse (as the real kernel)."""
    assert not is_causal
    f32 = jnp.float32
    B, Tk, Hkv, Dh = k.shape
    g = q.shape[2] // Hkv
    kk, vv = (jnp.repeat(x.astype(f32), g, axis=2) for x in (k, v))
    ok = _band(q.shape[1], Tk, (window_size_left, window_size_right))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), kk) * softmax_scale
    p = jnp.where(ok, jnp.exp(s - lse[..., None]), 0.0)
    do = dout.astype(f32)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(f32))
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", do, vv) - delta[..., None]) * softmax_scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(f32)).reshape(B, Tk, Hkv, g, Dh).sum(3)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, do).reshape(B, Tk, Hkv, g, Dh).sum(3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    pkg = types.ModuleType("flash_attn_jax")
    fwd = types.ModuleType("flash_attn_jax.flash_fwd")
    bwd = types.ModuleType("flash_attn_jax.flash_bwd")
    fwd.flash_mha_fwd, bwd.flash_mha_bwd = _stand_in_fwd, _stand_in_bwd
    pkg.flash_fwd, pkg.flash_bwd = fwd, bwd
    monkeypatch.setitem(sys.modules, "flash_attn_jax", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn_jax.flash_fwd", fwd)
    monkeypatch.setitem(sys.modules, "flash_attn_jax.flash_bwd", bwd)
    return pkg


@pytest.mark.parametrize("mask,q0,k0,Tq,Tk", [
    (MaskSpec(), 0, 0, 24, 40),                              # dense: positions irrelevant
    (MaskSpec(causal=True), 16, 0, 24, 40),                  # queries at the end
    (MaskSpec(causal=True), 0, 0, 32, 32),                   # a diagonal ring block
    (MaskSpec(causal=True), 100, 20, 16, 32),                # queries far after the keys
    (MaskSpec(window=(5, 3)), 16, 0, 24, 40),
    (MaskSpec(causal=True, window=(7, 0)), 10, 4, 20, 24),
], ids=["dense", "causal_end", "causal_diag", "causal_far", "window", "causal_window"])
def test_matches_reference(stand_in, mask, q0, k0, Tq, Tk):
    kern = FlashAttnKernel()
    q, k, v = make_qkv(1, B=2, S=Tq, Sk=Tk, Hq=4, Hkv=2, D=D, dtype=BF16)
    do = make_cotangent(1, q.shape, BF16)
    qp = np.arange(Tq, dtype=np.int32) + q0
    kp = np.arange(Tk, dtype=np.int32) + k0
    o, lse = kern.fwd(q, k, v, qp, kp, mask, D ** -0.5)
    grads = kern.bwd(q, k, v, o, lse, do, qp, kp, mask, D ** -0.5)
    ro, rlse, rgrads = reference_fwd_bwd(q, k, v, do, q_pos=jnp.asarray(qp),
                                         kv_pos=jnp.asarray(kp), causal=mask.causal,
                                         window=mask.window, scale=D ** -0.5)
    assert o.dtype == jnp.float32 and lse.shape == (2, 4, Tq)
    assert_close(o, ro, 2e-2, "out")
    assert_close(lse, rlse, 1e-3, "lse")
    for name, g, r in zip("qkv", grads, rgrads):
        assert g.dtype == jnp.float32
        assert_close(g, r, 2e-2, f"d{name}")


def test_window_translation():
    # causal, queries at the end of the keys: FlashAttention's own causal band
    assert flash_window(MaskSpec(causal=True), np.arange(8, 12), np.arange(12), 4, 12) == (-1, 0)
    # causal on a diagonal block of a ring step: the same band
    assert flash_window(MaskSpec(causal=True), np.arange(64, 96), np.arange(64, 96), 32, 32) == (-1, 0)
    # queries 10 positions after the keys' band: right side 10
    assert flash_window(MaskSpec(causal=True), np.arange(20, 24), np.arange(14), 4, 14) == (-1, 10)


@pytest.mark.parametrize("q_pos,kv_pos,pattern", [
    (np.arange(0, 8), np.arange(8, 16), "negative window side"),  # keys after queries
    (np.array([0, 2, 4, 6]), np.arange(8), "contiguous q_pos"),     # a striped shard
])
def test_refuses_what_flash_cannot_express(stand_in, q_pos, kv_pos, pattern):
    q, k, v = make_qkv(2, B=1, S=len(q_pos), Sk=len(kv_pos), Hq=2, Hkv=2, D=D, dtype=BF16)
    with pytest.raises(NotImplementedError, match=pattern):
        FlashAttnKernel().fwd(q, k, v, q_pos, kv_pos, MaskSpec(causal=True), 0.2)


def test_refuses_traced_positions_for_causal(stand_in):
    q, k, v = make_qkv(3, B=1, S=8, Hq=2, Hkv=2, D=D, dtype=BF16)
    f = jax.jit(lambda qp: FlashAttnKernel().fwd(q, k, v, qp, jnp.arange(8), MaskSpec(causal=True), 0.2))
    with pytest.raises(NotImplementedError, match="static q_pos"):
        f(jnp.arange(8))


def test_refuses_backward_without_o(stand_in):
    q, k, v = make_qkv(4, B=1, S=8, Hq=2, Hkv=2, D=D, dtype=BF16)
    with pytest.raises(NotImplementedError, match="needs the output o"):
        FlashAttnKernel().bwd(q, k, v, None, jnp.zeros((1, 2, 8)), q, np.arange(8),
                              np.arange(8), MaskSpec(), 0.2, delta=jnp.zeros((1, 2, 8)))


@pytest.mark.parametrize("kw,pattern", [
    (dict(dtype="float32"), "supports"), (dict(head_dim=260), "head_dim=260"),
    (dict(has_segments=True), "segment ids"),
])
def test_check_refusals(stand_in, kw, pattern):
    req = dict(platform="gpu", dtype="bfloat16", head_dim=128, mask=MaskSpec())
    req.update(kw)
    with pytest.raises(NotImplementedError, match=pattern):
        get_kernel("flash_attn", KernelRequest(**req))


def test_missing_package_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_jax", None)  # import fails
    req = KernelRequest(platform="gpu", dtype="bfloat16", head_dim=128, mask=MaskSpec())
    with pytest.raises(NotImplementedError, match="needs the flash-attn-jax package"):
        get_kernel("flash_attn", req)
    assert get_kernel("auto", req).name != "flash_attn"


def test_causal_ring_runs_on_flash_attn_through_tile_kinds(stand_in):
    """Inside a ring the positions are traced, yet a causal zigzag ring now runs entirely
    on flash_attn: its off-diagonal tiles are dense and its diagonal tiles aligned."""
    import jax_seqpar as jsp
    from helpers import make_mesh

    q, k, v = make_qkv(6, B=1, S=64, Hq=4, Hkv=2, D=D, dtype=BF16)
    do = make_cotangent(6, q.shape, BF16)
    ref_out, _, ref_grads = reference_fwd_bwd(q, k, v, do, causal=True)
    f = lambda q, k, v: jsp.attention(q, k, v, mesh=make_mesh(4), causal=True,  # noqa: E731
                                      layout="zigzag", kernel="flash_attn")
    out, vjp = jax.vjp(f, q, k, v)
    assert_close(out, ref_out, 2e-2, "out")
    for g, r in zip(vjp(do), ref_grads):
        assert_close(g, r, 2e-2, "grad")
    # a striped layout makes general tiles, which flash_attn refuses by name
    with pytest.raises(NotImplementedError, match="static q_pos"):
        jsp.attention(q, k, v, mesh=make_mesh(4), causal=True, layout="striped",
                      kernel="flash_attn")


def test_benchmark_check_reaches_general_tiles(stand_in, monkeypatch):
    """``benchmarks/kernels.py --phases check`` runs flash_attn's general tiles (static
    positions: its fwd and bwd called as ``local_attention`` calls them), not only the
    aligned ones: under JAX 0.11 every position reached through ``custom_vjp`` is traced,
    and the check refused these cases.  Segment ids still reach the backend, which
    refuses them."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernels as kb

    rows = kb.check({"flash_attn": FlashAttnKernel()}, [D], ["bfloat16"],
                    cases=["ragged_causal_mqa", "window_aligned", "window_segments"])
    got = {(r["case"], r["kernel"]): r["ok"] for r in rows}
    assert got == {("ragged_causal_mqa", "flash_attn"): True,
                   ("window_aligned", "flash_attn"): True,
                   ("window_aligned", "flash_attn@aligned"): True}, got
