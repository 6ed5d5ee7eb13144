"""Issue 41, item 1: the optional ``tokamax`` backend, with a stand-in on CPU.

tokamax's Mosaic GPU kernel does not run on CPU.  Its logic is tested with a stand-in for
the two module functions the backend calls (``tokamax_fwd`` / ``tokamax_bwd``): dense
float32 math that, like tokamax, applies causal masks and windows *by index* and speaks
tokamax's residual convention ``(m, l)`` (row maximum, sum of ``exp(s - m)``), so the
conversion to and from the contract's lse is exercised, and whose backward uses the
``o`` and residuals it is given.  A ring whose strategies labelled a tile wrongly, or
passed a tile's own ``o`` instead of the global one, would fail here.  The real kernel is
checked on the GPU by ``benchmarks/tokamax_tiles.py`` (RESULTS.md).
"""


import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_seqpar.kernels import base
from jax_seqpar.kernels import tokamax as tk
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, TILE_GENERAL, KernelRequest
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel import common

BF16, F32 = jnp.bfloat16, jnp.float32
CALLS = []


def _ok(Tq, Tk, causal, window):
    i, j = np.arange(Tq)[:, None], np.arange(Tk)[None, :]
    ok = np.ones((Tq, Tk), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    return jnp.asarray(ok)


def fake_fwd(q, k, v, *, scale, causal, window=None):
    CALLS.append(("fwd", causal, window))
    s = helpers.index_masked_scores(q, k, scale, _ok(q.shape[1], k.shape[1], causal, window))
    m = s.max(-1)
    e = jnp.exp(s - m[..., None])
    l = e.sum(-1)
    return helpers.probs_times_v(e / l[..., None], v).astype(q.dtype), (m, l)


def fake_bwd(q, k, v, o, residuals, do, *, scale, causal, window=None, kv_len=None):
    """tokamax's backward: ``P = exp(s - m) / l`` from the residuals it is given, on whole
    tiles only (tokamax 0.0.17 gives NaN past a ragged length: the backend pads), keys
    from ``kv_len`` on masked."""
    CALLS.append(("bwd", causal, window, q.shape[1], k.shape[1], kv_len))
    assert q.shape[1] % tk.ROW_TILE == 0 and k.shape[1] % tk.ROW_TILE == 0, \
        "tokamax's backward was handed a ragged length"
    m, l = residuals
    ok = _ok(q.shape[1], k.shape[1], causal, window)
    if kv_len is not None:
        ok &= jnp.arange(k.shape[1]) < kv_len
    s = helpers.index_masked_scores(q, k, scale, ok)
    p = jnp.where(ok, jnp.exp(s - m[..., None]) / l[..., None], 0.0)
    return helpers.backward_from_probs(q, k, v, o, p, do, scale)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Requests say platform 'gpu' (Hopper, tokamax importable); calls go to the stand-in."""
    monkeypatch.setattr(tk, "tokamax_fwd", fake_fwd)
    monkeypatch.setattr(tk, "tokamax_bwd", fake_bwd)
    monkeypatch.setattr(tk, "tokamax_module", lambda: (None, None))
    monkeypatch.setattr(tk, "_is_hopper_or_later", lambda: True)
    monkeypatch.setattr(common, "default_platform", lambda: "gpu")
    CALLS.clear()
    yield CALLS


def _request(**kw):
    d = dict(platform="gpu", dtype="bfloat16", head_dim=64, mask=MaskSpec(causal=True),
             tile=TILE_ALIGNED)
    d.update(kw)
    return KernelRequest(**d)


@pytest.mark.parametrize("mask,tile,want", [
    (MaskSpec(), TILE_DENSE, (False, None)),
    (MaskSpec(), TILE_GENERAL, (False, None)),     # no mask: positions do not matter
    (MaskSpec(causal=True), TILE_ALIGNED, (True, None)),
    (MaskSpec(window=(3, 0)), TILE_ALIGNED, (False, (3, 0))),
    (MaskSpec(window=(5, 2)), TILE_ALIGNED, (False, (5, 2))),  # right of the diagonal
    (MaskSpec(causal=True, window=(5, 2)), TILE_ALIGNED, (False, (5, 0))),
])
def test_mask_translation(mask, tile, want):
    assert tk.tokamax_mask(mask, tile) == want


@pytest.mark.parametrize("kw,match", [
    (dict(platform="cpu"), "NVIDIA GPUs only"),
    (dict(dtype="float32"), "not float32"),
    (dict(head_dim=96), "head_dim=96"),
    (dict(has_segments=True), "no segment ids"),
    (dict(bwd_has_o=False), "needs the forward output"),
    (dict(tile=TILE_GENERAL), "only dense tiles and aligned"),
    (dict(mask=MaskSpec(causal=True), tile=TILE_DENSE), "dense tile was given a mask"),
])
def test_refuses_what_it_cannot_honour(fake_gpu, kw, match):
    with pytest.raises(NotImplementedError, match=match):
        tk.TokamaxKernel().check(_request(**kw))


def test_not_installed_or_not_hopper_is_said(monkeypatch):
    monkeypatch.setattr(tk, "_is_hopper_or_later", lambda: True)
    try:
        import tokamax  # noqa: F401
    except ImportError:
        with pytest.raises(NotImplementedError, match=r"jax_seqpar\[tokamax\]"):
            tk.TokamaxKernel().check(_request())
    monkeypatch.setattr(tk, "tokamax_module", lambda: (None, None))
    monkeypatch.setattr(tk, "_is_hopper_or_later", lambda: False)
    with pytest.raises(NotImplementedError, match="Hopper"):
        tk.TokamaxKernel().check(_request())


def test_auto_order_puts_it_after_pallas_mgpu_for_dense_and_aligned_only():
    """Measured (base.AUTO_ORDER's comment): pallas_mgpu is ahead of it in every cell,
    cuDNN on the D 128 tiles and dense ones, pallas_mgpu first on aligned tiles at D 64."""
    for tile in (TILE_DENSE, TILE_ALIGNED):
        order = base.AUTO_ORDER[("gpu", tile)]
        assert order.index("cudnn") < order.index("pallas_mgpu") < order.index("tokamax")
    order = base.AUTO_ORDER[("gpu", TILE_ALIGNED, 64)]
    assert order.index("pallas_mgpu") < order.index("cudnn") < order.index("tokamax")
    assert "tokamax" not in base.AUTO_ORDER[("gpu", TILE_GENERAL)]
    assert "tokamax" in base.available_kernels()


def test_lse_from_residuals_and_a_tile_against_the_reference(fake_gpu):
    """One aligned tile straight through the backend: out, lse and gradients."""
    q, k, v = helpers.make_qkv(3, B=2, S=48, Hq=4, Hkv=2, D=64, dtype=BF16)
    do = helpers.make_cotangent(3, q.shape, BF16)
    pos = jnp.arange(48, dtype=jnp.int32)
    kern, mask, scale = tk.TokamaxKernel(), MaskSpec(window=(9, 4)), 64 ** -0.5
    o, lse = kern.fwd(q, k, v, pos, pos, mask, scale, tile=TILE_ALIGNED)
    ro, rlse, rg = helpers.reference_fwd_bwd(q, k, v, do, window=(9, 4))
    helpers.assert_close(o, ro, 2e-2, "out")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse, np.float32), rtol=1e-5,
                               atol=1e-5)
    grads = kern.bwd(q, k, v, o, lse, do, pos, pos, mask, scale, tile=TILE_ALIGNED)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        assert g.dtype == F32
        helpers.assert_close(g, r, 2e-2, name)
    assert [c[0] for c in fake_gpu] == ["fwd", "bwd"] and fake_gpu[0][2] == (9, 4)


@pytest.mark.parametrize("Tq,Tk,mask,tile", [
    (200, 200, MaskSpec(causal=True), TILE_ALIGNED),
    (300, 300, MaskSpec(window=(40, 7)), TILE_ALIGNED),   # a window past the diagonal
    (200, 330, MaskSpec(), TILE_DENSE),
    (256, 512, MaskSpec(), TILE_DENSE),                   # whole tiles: passed as they are
])
def test_backward_pads_ragged_lengths_to_whole_tiles(fake_gpu, Tq, Tk, mask, tile):
    """The backward hands tokamax whole tiles: zero rows past ``Tq`` with ``m = +inf`` (no
    probability), keys past ``Tk`` masked by a key range, gradients cut back; scores far
    below 0 (where a padded key let through would dominate) match the reference."""
    q, k, v = helpers.make_qkv(5, B=1, S=Tq, Sk=Tk, Hq=2, Hkv=1, D=64, dtype=BF16)
    # every score far below 0 (around -100): keys share a part that the queries oppose
    q = (0.5 * q - 12.0).astype(BF16)
    k = (0.5 * k + 1.5).astype(BF16)
    do = helpers.make_cotangent(5, q.shape, BF16)
    kern, scale = tk.TokamaxKernel(), 64 ** -0.5
    qp, kp = jnp.arange(Tq, dtype=jnp.int32), jnp.arange(Tk, dtype=jnp.int32)
    o, lse = kern.fwd(q, k, v, qp, kp, mask, scale, tile=tile)
    ro, rlse, rg = helpers.reference_fwd_bwd(q, k, v, do, causal=mask.causal,
                                             window=mask.window)
    assert float(jnp.max(rlse)) < -40   # the regime where padded keys would overflow
    grads = kern.bwd(q, k, v, o, lse, do, qp, kp, mask, scale, tile=tile)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, rg, (Tq, Tk, Tk)):
        assert g.shape[1] == n and bool(jnp.isfinite(g).all()), name
        helpers.assert_close(g, r, 2e-2, name)
    _, causal, window, tq, tkk, kv_len = fake_gpu[-1]
    assert (tq, tkk) == (-(-Tq // 256) * 256, -(-Tk // 256) * 256)
    assert kv_len == (None if Tk % 256 == 0 else Tk)


def _ring_grad(G, causal, layout, backward, window):
    return helpers.ring_fwd_bwd(G, causal, layout, backward, window, "auto")


@pytest.mark.parametrize("G,causal,layout,backward,window", [
    (1, False, "contiguous", "kv", (6, 5)),   # one aligned tile, a window both sides
    (4, True, "zigzag", "kv", None),
    (4, True, "contiguous", "q", None),
    (2, False, "zigzag", "q", None),
])
def test_ring_with_auto_uses_it_where_cudnn_refuses(fake_gpu, monkeypatch, G, causal,
                                                    layout, backward, window):
    """cuDNN and pallas_mgpu absent (refused), so ``auto`` gives dense and aligned tiles
    to tokamax and general ones to the next backend; the ring matches the reference."""
    from jax_seqpar.kernels import cudnn, pallas_mgpu

    def refuse(self, request):
        raise NotImplementedError("refused in this test")
    monkeypatch.setattr(cudnn.CudnnKernel, "check", refuse)
    monkeypatch.setattr(pallas_mgpu.PallasMgpuKernel, "check", refuse)
    B, S, Hq, Hkv, D = 2, 64, 4, 2, 64
    q, k, v = helpers.make_qkv(G + 5, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, dtype=BF16)
    do = helpers.make_cotangent(G, q.shape, BF16)
    ro, _, rg = helpers.reference_fwd_bwd(q, k, v, do, causal=causal, window=window)
    out, grads = _ring_grad(G, causal, layout, backward, window)(q, k, v, do)
    helpers.assert_close(out, ro, 2e-2, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        helpers.assert_close(g, r, 2e-2, name)
    kinds = {c[:2] for c in fake_gpu}
    assert ("fwd", False, window) in fake_gpu if window else ("fwd", causal) in kinds
    assert any(c[0] == "bwd" for c in fake_gpu)


def test_ragged_probe_blames_tokamax_not_the_backend(fake_gpu, monkeypatch, tmp_path):
    """``benchmarks/tokamax_ragged_probe.py`` with stand-ins: a public call that, like
    tokamax 0.0.17, returns NaN in dV past a ragged length is reported as such, and the
    exit status judges only the backend (padded: finite, within budget)."""
    import functools
    import json
    import sys
    import types
    from pathlib import Path

    import jax

    def plain(q, k, v, causal, scale):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def attn(q, k, v, causal, scale):
        return plain(q, k, v, causal, scale)

    def attn_fwd(q, k, v, causal, scale):
        return plain(q, k, v, causal, scale), (q, k, v)

    def attn_bwd(causal, scale, res, g):
        dq, dk, dv = jax.vjp(lambda *a: plain(*a, causal, scale), *res)[1](g)
        if res[0].shape[1] % 128:  # tokamax 0.0.17's NaN past a ragged length
            dv = dv.at[:, -1].set(jnp.nan)
        return dq, dk, dv
    attn.defvjp(attn_fwd, attn_bwd)
    fake = types.ModuleType("tokamax")
    fake.dot_product_attention = (lambda q, k, v, is_causal, scale, implementation:
                                  attn(q, k, v, is_causal, scale))
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["probe", "--dims", "64", "--lengths", "200",
                                      "--dtypes", "bfloat16"])
    import tokamax_ragged_probe as probe
    assert probe.main() == 0
    rows = json.loads((tmp_path / "tokamax_ragged_probe.json").read_text())["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["tokamax_public"]["nan_dq_dk_dv"][2] > 0
        assert r["backend"]["nan_dq_dk_dv"] == [0, 0, 0]
        assert max(r["backend"]["err_out_dq_dk_dv"]) <= r["budget"]
    # --masks picks the cases (the GPU's call limit reaches the dense ones only so)
    monkeypatch.setattr(sys, "argv", sys.argv + ["--masks", "dense"])
    assert probe.main() == 0
    rows = json.loads((tmp_path / "tokamax_ragged_probe.json").read_text())["rows"]
    assert [r["causal"] for r in rows] == [False, False]
    monkeypatch.setattr(sys, "argv", sys.argv[:-1] + ["sideways"])
    with pytest.raises(SystemExit):
        probe.main()
