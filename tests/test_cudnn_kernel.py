"""Issue 16: tile kinds in the kernel request, and the cuDNN backend (a stand-in on CPU).

cuDNN does not run on CPU.  Its logic is tested here with a stand-in for the two
``_compat`` functions the backend calls: dense float32 math that, like cuDNN, reads no
positions and applies causal masks and windows *by index*.  A ring whose strategies
labelled a tile "dense" or "aligned" wrongly would therefore give wrong results with it;
matching the reference proves the labels.  The stand-in's backward uses the ``o`` and
``lse`` it is given (as cuDNN's primitive does), so it also proves that the strategies
pass the *global* output and lse.  The real cuDNN is checked on the GPU by
``benchmarks/cudnn_tiles.py`` (RESULTS.md).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.runtime import _compat
from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.kernels import base
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, TILE_GENERAL, KernelRequest
from jax_seqpar.kernels.cudnn import CudnnKernel, cudnn_mask
from jax_seqpar.kernels.tiles import TileKernels
from jax_seqpar.kernels.xla import XlaKernel
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel import common
from jax_seqpar.parallel.costs import RingShape, backward_bytes

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
CALLS = []  # (kind, Tq, Tk) of every stand-in call, to see which tiles reached cuDNN


# ----------------------------------------------------------------- the stand-in "cuDNN"
def _index_mask(Tq, Tk, causal, window_left):
    i, j = np.arange(Tq)[:, None], np.arange(Tk)[None, :]
    ok = np.ones((Tq, Tk), bool)
    if causal:
        ok &= j <= i
    if window_left is not None:
        ok &= j >= i - window_left
    return jnp.asarray(ok)


def fake_fwd(q, k, v, *, scale, causal, window_left=None, with_lse=True):
    CALLS.append(("fwd" if with_lse else "fwd_no_lse", causal, q.shape[1], k.shape[1]))
    s = helpers.index_masked_scores(q, k, scale,
                                    _index_mask(q.shape[1], k.shape[1], causal, window_left))
    lse = jax.nn.logsumexp(s, axis=-1)
    o = helpers.probs_times_v(jnp.exp(s - lse[..., None]), v)
    return o.astype(q.dtype), (lse if with_lse else None)


def fake_bwd(q, k, v, o, lse, do, *, scale, causal, window_left=None):
    """FlashAttention-2 backward from the given o and lse (as cuDNN's primitive)."""
    CALLS.append(("bwd", causal, q.shape[1], k.shape[1]))
    ok = _index_mask(q.shape[1], k.shape[1], causal, window_left)
    s = helpers.index_masked_scores(q, k, scale, ok)
    p = jnp.where(ok, jnp.exp(s - lse[..., None]), 0.0)
    return helpers.backward_from_probs(q, k, v, o, p, do, scale)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Requests say platform 'gpu' and the cuDNN calls go to the stand-in."""
    monkeypatch.setattr(_compat, "cudnn_attention_fwd", fake_fwd)
    monkeypatch.setattr(_compat, "cudnn_attention_bwd", fake_bwd)
    monkeypatch.setattr(_compat, "cudnn_module", lambda: None)
    monkeypatch.setattr(common, "default_platform", lambda: "gpu")
    CALLS.clear()
    yield CALLS


def _request(**kw):
    base_kw = dict(platform="gpu", dtype="bfloat16", head_dim=64, mask=MaskSpec(causal=True))
    base_kw.update(kw)
    return KernelRequest(**base_kw)


# ------------------------------------------------------------------- mask translation
@pytest.mark.parametrize("mask,tile,want", [
    (MaskSpec(), TILE_DENSE, (False, None)),
    (MaskSpec(), TILE_GENERAL, (False, None)),          # no mask: positions do not matter
    (MaskSpec(causal=True), TILE_ALIGNED, (True, None)),
    (MaskSpec(window=(3, 0)), TILE_ALIGNED, (True, 3)),
    (MaskSpec(causal=True, window=(5, 2)), TILE_ALIGNED, (True, 5)),
])
def test_cudnn_mask_types(mask, tile, want):
    assert cudnn_mask(mask, tile) == want


@pytest.mark.parametrize("mask,tile,match", [
    (MaskSpec(causal=True), TILE_GENERAL, "general tile"),
    (MaskSpec(window=(3, 2)), TILE_ALIGNED, "diagonal"),
    (MaskSpec(causal=True), TILE_DENSE, "dense tile was given a mask"),
])
def test_cudnn_mask_refusals(mask, tile, match):
    with pytest.raises(NotImplementedError, match=match):
        cudnn_mask(mask, tile)


@pytest.mark.parametrize("kw,match", [
    (dict(platform="cpu"), "GPUs only"),
    (dict(dtype="float32"), "float32"),
    (dict(head_dim=60), "multiple of 8"),
    (dict(has_segments=True), "segment ids"),
    (dict(bwd_has_o=False), "output o"),
    (dict(tile=TILE_GENERAL), "general tile"),
])
def test_cudnn_refuses_what_it_cannot_honour(kw, match, monkeypatch):
    monkeypatch.setattr(_compat, "cudnn_module", lambda: None)
    with pytest.raises(NotImplementedError, match=match):
        CudnnKernel().check(_request(**{"tile": TILE_ALIGNED, **kw}))


def test_request_validates_tile():
    with pytest.raises(ValueError, match="tile"):
        _request(tile="diagonal")


# ------------------------------------------------------------- auto per tile kind
def _choices(monkeypatch, **kw):
    monkeypatch.setattr(_compat, "cudnn_module", lambda: None)
    return TileKernels("auto", _request(**kw)).choices


def test_auto_takes_cudnn_where_it_can_and_pallas_elsewhere(monkeypatch):
    assert _choices(monkeypatch) == {TILE_DENSE: "cudnn", TILE_ALIGNED: "cudnn",
                                     TILE_GENERAL: "pallas"}


@pytest.mark.parametrize("kw,want", [
    (dict(has_segments=True), {TILE_DENSE: "pallas", TILE_ALIGNED: "pallas",
                               TILE_GENERAL: "pallas"}),
    (dict(dtype="float32"), {TILE_DENSE: "pallas", TILE_ALIGNED: "pallas",
                             TILE_GENERAL: "pallas"}),
    (dict(bwd_has_o=False), {TILE_DENSE: "pallas", TILE_ALIGNED: "pallas",
                             TILE_GENERAL: "pallas"}),
    (dict(mask=MaskSpec(window=(4, 4))), {TILE_DENSE: "cudnn", TILE_ALIGNED: "pallas",
                                          TILE_GENERAL: "pallas"}),
    (dict(platform="cpu"), {TILE_DENSE: "xla", TILE_ALIGNED: "xla", TILE_GENERAL: "xla"}),
])
def test_auto_falls_back_per_tile(monkeypatch, kw, want):
    assert _choices(monkeypatch, **kw) == want


def test_auto_order_is_measured_and_consistent():
    """Every key of AUTO_ORDER is (platform, tile kind[, head dim]), every backend it names
    exists, a head dim's entry reorders its tile kind's backends without adding or
    dropping any, and the table says where its numbers came from."""
    for key, names in base.AUTO_ORDER.items():
        platform, tile, *dim = key
        assert tile in base.TILE_KINDS and platform in ("cpu", "gpu", "tpu")
        assert set(names) <= set(base.available_kernels()), names
        if dim:
            assert len(dim) == 1 and isinstance(dim[0], int) and dim[0] > 0, key
            assert sorted(names) == sorted(base.AUTO_ORDER[(platform, tile)]), key
    assert "auto_order.py" in open(base.__file__).read()


def test_short_rows_orders_are_measured_and_consistent():
    """Every entry of AUTO_ORDER_SHORT_ROWS is keyed (platform, tile kind, head dim), has a
    positive row limit, and reorders its tile kind's backends without adding or dropping
    any; the table says where its numbers came from."""
    assert base.AUTO_ORDER_SHORT_ROWS, "the table is empty: drop it or measure an entry"
    for key, (rows, names) in base.AUTO_ORDER_SHORT_ROWS.items():
        platform, tile, dim = key
        assert tile in base.TILE_KINDS and isinstance(dim, int) and dim > 0, key
        assert isinstance(rows, int) and rows > 0, key
        assert sorted(names) == sorted(base.AUTO_ORDER[(platform, tile)]), key
    text = open(base.__file__).read()
    assert "auto_order.py" in text and "Short rows at D 128" in text


def test_short_rows_reorder_only_tiles_of_that_many_rows(monkeypatch):
    monkeypatch.setitem(base.AUTO_ORDER_SHORT_ROWS, ("gpu", TILE_ALIGNED, 96),
                        (1024, ("xla", "cudnn")))
    monkeypatch.setitem(base.AUTO_ORDER, ("gpu", TILE_ALIGNED), ("cudnn", "xla"))
    assert base.auto_candidates("gpu", TILE_ALIGNED, 96, 1024)[:2] == ("xla", "cudnn")
    assert base.auto_candidates("gpu", TILE_ALIGNED, 96, 1025)[:2] == ("cudnn", "xla")
    assert base.auto_candidates("gpu", TILE_ALIGNED, 96)[:2] == ("cudnn", "xla")  # unknown
    assert base.auto_candidates("gpu", TILE_ALIGNED, 80, 16)[:2] == ("cudnn", "xla")
    assert base.short_rows_limit("gpu", TILE_ALIGNED, 96) == 1024
    assert base.short_rows_limit("gpu", TILE_DENSE, 96) is None
    with pytest.raises(ValueError, match="rows"):
        _request(rows=0)


@pytest.mark.parametrize("S,window,short", [(32, None, True), (64, None, False),
                                             (64, (7, 0), True)])
def test_auto_routes_each_aligned_tile_by_its_rows(fake_gpu, monkeypatch, S, window, short):
    """With a short-rows entry (a stand-in one: xla for aligned tiles of up to 16 rows at
    D 16), ``auto`` routes a ring's diagonal block by its length, in the forward and the
    backward alike.  A block of 16 rows goes to xla, which does not skip masked key
    blocks, so it gets the block's causal halves (8 rows; ``pairs._whole_own``); one of
    32 rows goes whole to the "cuDNN" stand-in, unless a window of 8 keys makes it short
    (``tiles.route_length``; the window's other tiles are general ones, which "cuDNN"
    refuses).  Dense tiles stay on cuDNN.  The result matches the reference every time."""
    monkeypatch.setitem(base.AUTO_ORDER_SHORT_ROWS, ("gpu", TILE_ALIGNED, 16),
                        (16, ("xla", "cudnn", "tokamax", "pallas_mgpu", "pallas")))
    xla_rows = []
    fwd, bwd = XlaKernel.fwd, XlaKernel.bwd

    def spy_fwd(self, q, *a, **kw):
        xla_rows.append(("fwd", q.shape[1]))
        return fwd(self, q, *a, **kw)

    def spy_bwd(self, q, *a, **kw):
        xla_rows.append(("bwd", q.shape[1]))
        return bwd(self, q, *a, **kw)
    monkeypatch.setattr(XlaKernel, "fwd", spy_fwd)
    monkeypatch.setattr(XlaKernel, "bwd", spy_bwd)
    G = 2
    q, k, v = helpers.make_qkv(5, B=1, S=S, Hq=4, Hkv=2, D=16, dtype=BF16)
    do = helpers.make_cotangent(5, q.shape, BF16)
    ref_out, _, ref_grads = helpers.reference_fwd_bwd(q, k, v, do, causal=True,
                                                      window=window)
    out, grads = helpers.ring_fwd_bwd(G, True, "contiguous", "kv", window, "auto")(q, k, v,
                                                                                   do)
    helpers.assert_close(out, ref_out, 2e-2, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        helpers.assert_close(g, r, 2e-2, name)
    causal_cudnn = {kind for kind, causal, _, _ in fake_gpu if causal}
    dense_cudnn = {kind for kind, causal, _, _ in fake_gpu if not causal}
    if window is None:  # the off-diagonal tile (under the window it is a general one)
        assert dense_cudnn >= {"fwd", "bwd"}
    if short:  # no aligned tile reached "cuDNN"
        assert not causal_cudnn and xla_rows
        if window is None:
            assert sorted(set(xla_rows)) == [("bwd", S // G // 2), ("fwd", S // G // 2)]
    else:
        assert not xla_rows and causal_cudnn >= {"fwd", "bwd"}
        assert {rows for _, causal, rows, _ in fake_gpu if causal} == {S // G}


def test_route_length_is_the_longer_side_or_the_window():
    from jax_seqpar.kernels.tiles import route_length
    assert route_length(MaskSpec(), 8, 32) == 32
    assert route_length(MaskSpec(causal=True), 16384, 16384) == 16384
    assert route_length(MaskSpec(causal=True, window=(2047, 0)), 16384, 16384) == 2048
    assert route_length(MaskSpec(window=(4, 4)), 64, 64) == 9
    assert route_length(MaskSpec(window=(4, 4)), 5, 5) == 5
    assert route_length(MaskSpec(causal=True, window=(2**31 - 1, 0)), 64, 64) == 64


def test_a_dense_tile_is_short_only_when_both_sides_are(fake_gpu, monkeypatch):
    """A tile goes to the short-rows backend when its query rows and its keys are both
    within the limit (the entries were measured with as many keys as rows): 16 x 16 to
    xla, 8 x 32 and 32 x 8 to the "cuDNN" stand-in."""
    monkeypatch.setitem(base.AUTO_ORDER_SHORT_ROWS, ("gpu", TILE_DENSE, 16),
                        (16, ("xla", "cudnn", "tokamax", "pallas_mgpu", "pallas")))
    tk = TileKernels("auto", _request(head_dim=16))
    assert tk.short_rows == {TILE_DENSE: (16, "xla")}
    for Tq, Tk, short in ((16, 16, True), (8, 32, False), (32, 8, False)):
        CALLS.clear()
        q, _, _ = helpers.make_qkv(Tq, B=1, S=Tq, Hq=2, Hkv=2, D=16, dtype=BF16)
        _, k, v = helpers.make_qkv(Tk, B=1, S=Tk, Hq=2, Hkv=2, D=16, dtype=BF16)
        o, lse = tk.fwd(q, k, v, jnp.arange(Tq), jnp.arange(Tk), MaskSpec(), 0.25,
                        tile=TILE_DENSE)
        assert o.shape == q.shape and lse.shape == (1, 2, Tq)
        assert (CALLS == []) == short, (Tq, Tk, CALLS)


def test_a_head_dim_entry_reorders_only_its_head_dim(monkeypatch):
    """``auto_candidates`` takes the head dim's entry where AUTO_ORDER has one, the tile
    kind's otherwise, then the remaining backends by priority."""
    monkeypatch.setitem(base.AUTO_ORDER, ("gpu", TILE_ALIGNED, 96), ("xla", "cudnn"))
    monkeypatch.setitem(base.AUTO_ORDER, ("gpu", TILE_ALIGNED), ("cudnn", "xla"))
    assert base.auto_candidates("gpu", TILE_ALIGNED, 96)[:2] == ("xla", "cudnn")
    assert base.auto_candidates("gpu", TILE_ALIGNED, 128)[:2] == ("cudnn", "xla")
    assert base.auto_candidates("gpu", TILE_ALIGNED)[:2] == ("cudnn", "xla")
    assert sorted(base.auto_candidates("gpu", TILE_ALIGNED, 96)) == sorted(
        base.available_kernels())



def test_gpu_orders_are_measured_and_consistent():
    """Every entry of AUTO_ORDER_GPU is keyed (GPU key, tile kind, head dim) and reorders
    its tile kind's GPU backends without adding or dropping any; the table says where its
    numbers came from."""
    assert base.AUTO_ORDER_GPU, "the table is empty: drop it or measure an entry"
    for key, names in base.AUTO_ORDER_GPU.items():
        gpu, tile, dim = key
        assert gpu == base.gpu_key(gpu) and tile in base.TILE_KINDS, key
        assert isinstance(dim, int) and dim > 0, key
        assert sorted(names) == sorted(base.AUTO_ORDER[("gpu", tile)]), key
    text = open(base.__file__).read()
    assert "auto_order.py" in text and "auto on the H200" in text


def test_a_gpu_entry_reorders_only_that_gpu(monkeypatch):
    """``auto_candidates`` takes the GPU's entry on that GPU, whatever the rows, and the
    usual orders on another GPU, on an unknown one and off GPUs."""
    monkeypatch.setitem(base.AUTO_ORDER_GPU, ("fake_h9", TILE_ALIGNED, 96), ("xla", "cudnn"))
    monkeypatch.setitem(base.AUTO_ORDER_SHORT_ROWS, ("gpu", TILE_ALIGNED, 96),
                        (64, ("pallas", "cudnn", "xla")))
    monkeypatch.setitem(base.AUTO_ORDER, ("gpu", TILE_ALIGNED), ("cudnn", "xla", "pallas"))
    cand = base.auto_candidates
    assert cand("gpu", TILE_ALIGNED, 96, None, "fake_h9")[:2] == ("xla", "cudnn")
    assert cand("gpu", TILE_ALIGNED, 96, 64, "fake_h9")[:2] == ("xla", "cudnn")
    assert cand("gpu", TILE_ALIGNED, 96, 64, "fake_h8")[:2] == ("pallas", "cudnn")
    assert cand("gpu", TILE_ALIGNED, 96, 65, "fake_h8")[:2] == ("cudnn", "xla")
    assert cand("gpu", TILE_ALIGNED, 96, None, None)[:2] == ("cudnn", "xla")
    assert cand("gpu", TILE_DENSE, 96, None, "fake_h9")[0] != "xla"
    assert cand("gpu", TILE_ALIGNED, 128, None, "fake_h9")[:2] == ("cudnn", "xla")
    assert cand("cpu", TILE_ALIGNED, 96, None, "fake_h9") == cand("cpu", TILE_ALIGNED, 96)
    assert sorted(cand("gpu", TILE_ALIGNED, 96, None, "fake_h9")) == sorted(
        base.available_kernels())


@pytest.mark.parametrize("gpu,want", [("fake_h9", "xla"), ("fake_h8", "cudnn"), (None, "cudnn")])
def test_a_call_carries_its_gpu_to_auto(fake_gpu, monkeypatch, gpu, want):
    """``make_config`` puts the GPU's kind (``base.default_gpu``) in the request, so an
    ``AUTO_ORDER_GPU`` entry decides that GPU's aligned tiles (a stand-in entry here),
    dense ones keep cuDNN, and another GPU keeps the usual order."""
    monkeypatch.setattr(common, "default_gpu", lambda: gpu)
    monkeypatch.setitem(base.AUTO_ORDER_GPU, ("fake_h9", TILE_ALIGNED, 16),
                        ("xla", "cudnn", "tokamax", "pallas_mgpu", "pallas"))
    q, k, _ = helpers.make_qkv(5, B=1, S=32, Hq=4, Hkv=2, D=16, dtype=BF16)
    cfg = common.make_config(q, k, axis_name="sp", causal=True, window=None,
                             segment_ids=None, scale=None, layout="contiguous",
                             backward="kv", kernel="auto")
    assert cfg.kernel.request.gpu == gpu
    choices = cfg.kernel.choices
    assert choices[TILE_ALIGNED] == want and choices[TILE_DENSE] == "cudnn", choices
    assert cfg.kernel.short_rows == {}


@pytest.mark.parametrize("bad", ["", "NVIDIA H200", 3])
def test_request_validates_gpu(bad):
    with pytest.raises(ValueError, match="gpu="):
        _request(gpu=bad)
    assert _request(gpu="nvidia_h200").gpu == "nvidia_h200"
    assert base.gpu_key("NVIDIA H200") == "nvidia_h200"


def test_ulysses_without_a_mask_is_a_dense_tile_in_any_layout(fake_gpu, monkeypatch):
    """Without a mask no position matters, so Ulysses' gathered sequence is a dense tile
    even in the striped layout (``parallel.common.tile_kind``), where ``auto`` tries cuDNN
    first; with a causal mask the striped positions make it general (cuDNN refuses)."""
    from jax_seqpar.parallel import ulysses
    tiles = []

    def spy(*args, tile, **kw):
        tiles.append(tile)
        return local_attention(*args, tile=tile, **kw)
    local_attention = ulysses.local_attention
    monkeypatch.setattr(ulysses, "local_attention", spy)
    q, k, v = helpers.make_qkv(3, B=1, S=32, Hq=4, Hkv=2, D=16, dtype=BF16)
    mesh = helpers.make_mesh(2)
    out = jsp.attention(q, k, v, mesh=mesh, strategy="ulysses", layout="striped",
                        kernel="cudnn")
    ref, _, _ = helpers.reference_fwd_bwd(q, k, v, q, None)
    helpers.assert_close(out, ref, 2e-2, "ulysses, striped, no mask")
    assert tiles == [TILE_DENSE]
    assert {(kind, causal) for kind, causal, _, _ in fake_gpu} == {("fwd_no_lse", False)}
    with pytest.raises(NotImplementedError, match="cannot serve a 'general' tile"):
        jsp.attention(q, k, v, mesh=mesh, strategy="ulysses", layout="striped",
                      causal=True, kernel="cudnn")
    assert tiles == [TILE_DENSE, TILE_GENERAL]


def test_forced_cudnn_names_the_refused_tile(fake_gpu):
    """Striped causal tiles are general (positions decide): kernel='cudnn' says so."""
    q, k, v = helpers.make_qkv(1, B=1, S=32, Hq=2, Hkv=2, D=16, dtype=BF16)
    with pytest.raises(NotImplementedError, match="cannot serve a 'general' tile"):
        jsp.attention(q, k, v, mesh=helpers.make_mesh(2), causal=True, layout="striped",
                      kernel="cudnn")


def test_cudnn_on_cpu_is_refused_clearly():
    q, k, v = helpers.make_qkv(1, B=1, S=32, Hq=2, Hkv=2, D=16, dtype=BF16)
    with pytest.raises(NotImplementedError, match="GPUs only"):
        jsp.attention(q, k, v, mesh=helpers.make_mesh(2), kernel="cudnn")


# ------------------------------------------------------------------ rings on "cuDNN"
def _ring_grad(G, causal, layout, backward, window):
    return helpers.ring_fwd_bwd(G, causal, layout, backward, window, "cudnn")


@pytest.mark.parametrize("G,Hq,Hkv,causal,layout,backward,dtype", [
    (1, 4, 2, True, "contiguous", "kv", BF16),
    (2, 4, 4, True, "zigzag", "q", F16),
    (4, 4, 2, True, "zigzag", "kv", BF16),
    (4, 4, 4, True, "zigzag", "q", BF16),
    (4, 2, 2, True, "contiguous", "q", BF16),
    (4, 4, 1, False, "contiguous", "kv", BF16),
    (8, 2, 2, False, "zigzag", "q", BF16),
])
def test_ring_on_cudnn_matches_reference(fake_gpu, G, Hq, Hkv, causal, layout, backward,
                                         dtype):
    B, S, D = 2, 64, 16
    q, k, v = helpers.make_qkv(G + Hq, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    do = helpers.make_cotangent(G, q.shape, dtype)
    ref_out, _, ref_grads = helpers.reference_fwd_bwd(q, k, v, do, causal=causal)
    out, grads = _ring_grad(G, causal, layout, backward, None)(q, k, v, do)
    tol = 2e-2
    helpers.assert_close(out, ref_out, tol, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype
        helpers.assert_close(g, r, tol, name)
    kinds = {(kind, c) for kind, c, _, _ in fake_gpu}
    assert ("fwd", False) in kinds or G == 1      # dense tiles reached cuDNN
    if causal:                                    # and so did the aligned diagonal ones
        assert ("fwd", True) in kinds and ("bwd", True) in kinds


@pytest.mark.parametrize("G,layout,whole", [(1, "contiguous", True), (2, "contiguous", True),
                                            (2, "zigzag", False)])
def test_own_block_reaches_cudnn_whole_under_contiguous(fake_gpu, G, layout, whole):
    """cuDNN skips a causal tile's masked blocks itself (``skips_masked_blocks``): under
    the contiguous layout a device's own block reaches it as one aligned tile; under
    zigzag the block is two chunks far apart, so it gets the causal halves."""
    B, S, H, D = 1, 48, 2, 16
    q, k, v = helpers.make_qkv(11, B=B, S=S, Hq=H, Hkv=H, D=D, dtype=BF16)
    do = helpers.make_cotangent(11, q.shape, BF16)
    out, grads = _ring_grad(G, True, layout, "kv", None)(q, k, v, do)
    ref_out, _, ref_grads = helpers.reference_fwd_bwd(q, k, v, do, causal=True)
    helpers.assert_close(out, ref_out, 2e-2, "out")
    for g, r in zip(grads, ref_grads):
        helpers.assert_close(g, r, 2e-2, "grad")
    T = S // G
    side = T if whole else T // 2
    assert sorted({(kind, tq, tk) for kind, causal, tq, tk in fake_gpu if causal}) == [
        ("bwd", side, side), ("fwd", side, side)]


class _Recording(XlaKernel):
    """The xla kernel, recording the query and key lengths of its causal forward calls;
    ``skips_masked_blocks`` as the subclass says."""

    def fwd(self, q, k, v, q_pos, kv_pos, mask, scale, q_seg=None, kv_seg=None):
        if not mask.is_dense:
            _RECORDED.append((self.skips_masked_blocks, q.shape[1], k.shape[1]))
        return super().fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg)


class _Skips(_Recording):
    skips_masked_blocks = True


class _Branches(_Recording):
    skips_masked_blocks = False  # as the xla kernel: one lax.cond per key block


_RECORDED = []


@pytest.mark.parametrize("kernel", [_Skips(), _Branches()])
def test_own_block_is_split_only_for_backends_that_branch_per_block(kernel):
    """One device, causal, contiguous: a backend with ``skips_masked_blocks`` runs the
    block as one call; one without (the xla kernel tests each key block with a
    ``lax.cond``) gets the halves, which spare it the masked quarter."""
    S = 40
    q, k, v = helpers.make_qkv(12, B=1, S=S, Hq=2, Hkv=2, D=8)
    _RECORDED.clear()
    out = jsp.attention(q, k, v, mesh=helpers.make_mesh(1), causal=True, kernel=kernel)
    helpers.assert_close(out, helpers.reference_fwd_bwd(q, k, v, q, causal=True)[0], 1e-5,
                         "out")
    whole = kernel.skips_masked_blocks
    assert _RECORDED == ([(True, S, S)] if whole else [(False, S // 2, S // 2)] * 2)


def test_ring_window_on_contiguous_diagonal(fake_gpu):
    """One device, a causal window: the whole block is an aligned tile with a band."""
    q, k, v = helpers.make_qkv(5, B=1, S=48, Hq=2, Hkv=2, D=16, dtype=BF16)
    do = helpers.make_cotangent(5, q.shape, BF16)
    ref_out, _, ref_grads = helpers.reference_fwd_bwd(q, k, v, do, causal=True, window=(7, 0))
    out, grads = _ring_grad(1, True, "contiguous", "kv", (7, 0))(q, k, v, do)
    helpers.assert_close(out, ref_out, 2e-2, "out")
    for g, r in zip(grads, ref_grads):
        helpers.assert_close(g, r, 2e-2, "grad")


# ----------------------------------------------- Burst with a backend that needs o
class _NeedsO(XlaKernel):
    """The xla kernel, but its backward insists on ``o`` (as cuDNN's does)."""

    needs_o = True

    def bwd(self, q, k, v, o, lse, do, *args, delta=None, **kw):
        assert o is not None, "a needs_o backend was called without o"
        return super().bwd(q, k, v, o, lse, do, *args, delta=None, **kw)


def test_burst_carries_o_for_backends_that_need_it():
    """backward='q' with a needs_o backend: O travels in place of D, gradients still
    match, and the bytes equal ``backward_bytes`` with ``o_travels`` (float32 on CPU)."""
    G, B, S, Hq, D = 4, 1, 64, 4, 16
    q, k, v = helpers.make_qkv(9, B=B, S=S, Hq=Hq, Hkv=Hq, D=D)
    do = helpers.make_cotangent(9, q.shape)
    mesh = helpers.make_mesh(G)
    f = lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=True,  # noqa: E731
                                      backward="q", kernel=_NeedsO())
    _, vjp = jax.vjp(f, q, k, v)
    _, _, ref = helpers.reference_fwd_bwd(q, k, v, do, causal=True)
    for g, r in zip(vjp(do), ref):
        helpers.assert_close(g, r, 1e-5, "grad")
    rep = collective_bytes(jax.jit(lambda vjp, do: vjp(do)), vjp, do)
    shape = RingShape(G, B, S // G, Hq, Hq, D, 4, o_travels=True)
    assert rep.total_bytes == backward_bytes("q", shape)
    assert backward_bytes("q", shape) > backward_bytes(
        "q", RingShape(G, B, S // G, Hq, Hq, D, 4))


def test_local_forward_without_gradient_skips_lse(fake_gpu):
    """A forward nobody differentiates runs cuDNN's inference kernel (no statistics);
    under a gradient the forward keeps lse for the backward."""
    from jax_seqpar.parallel.local import local_attention

    q, k, v = helpers.make_qkv(4, B=1, S=32, Hq=2, Hkv=2, D=16, dtype=BF16)
    cfg = common.make_config(q, k, axis_name="sp", causal=True, window=None,
                             segment_ids=None, scale=None, layout="contiguous",
                             backward="kv", kernel="cudnn")
    pos = jnp.arange(32, dtype=jnp.int32)
    f = lambda q, k, v: local_attention(cfg, q, k, v, pos, pos, tile=TILE_ALIGNED)  # noqa
    out = jax.jit(f)(q, k, v)
    assert [c[0] for c in fake_gpu] == ["fwd_no_lse"]
    ref, _ = jsp.reference_attention(q.astype(F32), k.astype(F32), v.astype(F32), causal=True)
    helpers.assert_close(out, ref, 2e-2, "out")
    fake_gpu.clear()
    jax.grad(lambda q: f(q, k, v).astype(F32).sum())(q)
    assert [c[0] for c in fake_gpu] == ["fwd", "bwd"]
