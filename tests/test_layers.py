"""Flax layers: Linen and NNX ``SeqParallelAttention`` and the ``attention_fn`` adapter.

Each sequence-parallel layer is compared, outputs and gradients (parameters and inputs),
with a plain single-device attention layer written here from the same parameters:
einsum projections, RoPE in its complex-number form at natural positions, and the dense
float32 ``reference_attention``.  Inputs of the layers under test are in layout order
when ``permuted=True``; their outputs are put back in natural order to compare.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from helpers import F32, assert_close, assert_trees_close, sorted_segments
from jax_seqpar import reference_attention
from jax_seqpar.layers import (SeqParallelAttention, SeqParallelOptions, apply_rope,
                               make_attention_fn)
from jax_seqpar.layers import nnx as spnnx
from jax_seqpar.layouts import permute_sequence, unpermute_sequence

B, S, DM, HQ, HKV, D = 2, 64, 32, 4, 2, 8
TOL = 1e-5
HI = jax.lax.Precision.HIGHEST


@functools.lru_cache(maxsize=None)
def auto_mesh(G):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))


def inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 2)
    return (jax.random.normal(ks[0], (B, S, DM), F32),
            jax.random.normal(ks[1], (B, S, DM), F32))


# ------------------------------------------------------------------ the plain layer
def rope_complex(x, pos, theta=10000.0):
    """RoPE as a complex rotation: (x1 + i x2) * exp(i * pos * theta^(-2c/D))."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=F32) * 2 / x.shape[-1])
    rot = jnp.exp(1j * (pos.astype(F32)[:, None] * freq))[None, :, None, :]
    z = jax.lax.complex(x[..., :half], x[..., half:]) * rot
    return jnp.concatenate([z.real, z.imag], axis=-1)


def plain_layer(params, x, seg=None, *, causal=False, window=None):
    """Single-device attention layer with the parameter tree of SeqParallelAttention."""
    def proj(name):
        return jnp.einsum("bsd,dhk->bshk", x, params[name]["kernel"], precision=HI)

    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    pos = jnp.arange(x.shape[1])
    q, k = rope_complex(q, pos), rope_complex(k, pos)
    o, _ = reference_attention(q, k, v, causal=causal, window=window, segment_ids=seg)
    return jnp.einsum("bshk,hkd->bsd", o, params["o_proj"]["kernel"], precision=HI)


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def plain_fwd_bwd(params, x, ct, seg, causal, window):
    f = lambda p, x: plain_layer(p, x, seg, causal=causal, window=window)  # noqa: E731
    out, vjp = jax.vjp(f, params, x)
    return out, vjp(ct)


def to_layout(x, opts, permuted):
    if x is None or not permuted:
        return x
    return permute_sequence(x, opts.layout, opts.num_shards)


def from_layout(x, opts, permuted):
    return unpermute_sequence(x, opts.layout, opts.num_shards) if permuted else x


def check_against_plain(out, grads_p, grad_x, params, x, ct, seg, causal, window, what):
    ro, (rgp, rgx) = plain_fwd_bwd(params, x, ct, seg, causal, window)
    assert_close(out, ro, TOL, f"{what}: out")
    assert_close(grad_x, rgx, TOL, f"{what}: dx")
    assert_trees_close(grads_p, rgp, TOL, f"{what}: dparams")


# ------------------------------------------------------------------ Linen
LINEN_CASES = {
    "zigzag_causal_gqa_G8": dict(G=8, layout="zigzag", permuted=True, causal=True),
    "striped_causal_segments_G4": dict(G=4, layout="striped", permuted=True, causal=True,
                                       seg=True, backward="q"),
    "zigzag_window_natural_order_G2": dict(G=2, layout="zigzag", permuted=False,
                                           window=(5, 3)),
    "zigzag_seq_selective_G4": dict(G=4, layout="zigzag", permuted=True, causal=True,
                                    seq_selective=True),
    "allgather_zigzag_G4": dict(G=4, layout="zigzag", permuted=True, causal=True,
                                strategy="allgather"),
}


@pytest.mark.parametrize("case", list(LINEN_CASES))
def test_linen_matches_plain_layer(case):
    kw = dict(LINEN_CASES[case])
    G, seg_on = kw.pop("G"), kw.pop("seg", False)
    causal, window, permuted = kw.get("causal", False), kw.get("window"), kw["permuted"]
    model = SeqParallelAttention(num_heads=HQ, head_dim=D, num_kv_heads=HKV,
                                 mesh=auto_mesh(G), **kw)
    opts = model.options()
    x, ct = inputs()
    seg = sorted_segments(0, B, S, num_docs=3) if seg_on else None
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    xl, ctl, segl = (to_layout(a, opts, permuted) for a in (x, ct, seg))

    @jax.jit
    def fwd_bwd(params, x):
        out, vjp = jax.vjp(lambda p, x: model.apply({"params": p}, x, segl), params, x)
        return out, vjp(ctl)

    out, (gp, gx) = fwd_bwd(params, xl)
    check_against_plain(from_layout(out, opts, permuted), gp, from_layout(gx, opts, permuted),
                        params, x, ct, seg, causal, window, case)


def test_linen_single_device_path_matches_plain_layer():
    """``mesh=None`` is plain attention; GQA and a causal window."""
    model = SeqParallelAttention(num_heads=HQ, head_dim=D, num_kv_heads=HKV, causal=True,
                                 window=(7, 0))
    x, ct = inputs(3)
    params = jax.jit(model.init)(jax.random.key(2), x)["params"]
    out, vjp = jax.vjp(lambda p, x: model.apply({"params": p}, x), params, x)
    gp, gx = vjp(ct)
    check_against_plain(out, gp, gx, params, x, ct, None, True, (7, 0), "mesh=None")


# ------------------------------------------------------------------ NNX
def nnx_from_linen(params, **kw):
    m = spnnx.SeqParallelAttention(DM, HQ, D, num_kv_heads=HKV, rngs=nnx.Rngs(0), **kw)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(m, name).kernel[...] = params[name]["kernel"]
    return m


@pytest.mark.parametrize("G,layout,backward", [(8, "zigzag", "kv"), (2, "striped", "q")])
def test_nnx_matches_plain_layer(G, layout, backward):
    linen = SeqParallelAttention(num_heads=HQ, head_dim=D, num_kv_heads=HKV)
    x, ct = inputs(5)
    params = jax.jit(linen.init)(jax.random.key(4), x)["params"]
    model = nnx_from_linen(params, mesh=auto_mesh(G), layout=layout, permuted=True,
                           causal=True, backward=backward)
    opts = model.options
    graph, state = nnx.split(model)

    @jax.jit
    def fwd_bwd(state, x):
        out, vjp = jax.vjp(lambda s, x: nnx.merge(graph, s)(x), state, x)
        return out, vjp(to_layout(ct, opts, True))

    out, (gs, gx) = fwd_bwd(state, to_layout(x, opts, True))
    grads = {name: {"kernel": getattr(gs, name).kernel[...]}
             for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    check_against_plain(from_layout(out, opts, True), grads, from_layout(gx, opts, True),
                        params, x, ct, None, True, None, f"nnx G={G} {layout}")


def test_nnx_and_linen_share_parameter_shapes():
    linen = SeqParallelAttention(num_heads=HQ, head_dim=D, num_kv_heads=HKV)
    params = linen.init(jax.random.key(0), jnp.zeros((1, 8, DM)))["params"]
    m = spnnx.SeqParallelAttention(DM, HQ, D, num_kv_heads=HKV, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal_shapes(
        params, {name: {"kernel": getattr(m, name).kernel[...]} for name in params})


# ------------------------------------------------------------------ RoPE
def test_rope_uses_global_positions():
    """Rotating at ``permutation`` positions then un-permuting equals rotating in order,
    and scores depend on position differences only."""
    x = jax.random.normal(jax.random.key(0), (1, S, 2, D))
    opts = SeqParallelOptions(mesh=auto_mesh(4), layout="zigzag", permuted=True)
    pos = opts.positions(S)
    assert sorted(pos.tolist()) == list(range(S)) and pos.tolist() != list(range(S))
    rotated = unpermute_sequence(apply_rope(permute_sequence(x, "zigzag", 4), pos), "zigzag", 4)
    assert_close(rotated, apply_rope(x, np.arange(S)), 1e-6, "rope under zigzag")
    assert_close(apply_rope(x, np.arange(S)), rope_complex(x, jnp.arange(S)), 1e-6, "rope form")
    q, k = x[:, :1, :1], x[:, 1:2, :1]
    score = lambda i, j: float(jnp.vdot(apply_rope(q, np.array([i])),  # noqa: E731
                                        apply_rope(k, np.array([j]))))
    assert abs(score(10, 3) - score(57, 50)) < 1e-4 and abs(score(10, 3) - score(10, 4)) > 1e-3


# ------------------------------------------------------------------ adapter
def test_attention_fn_in_linen_multihead_attention():
    mesh = auto_mesh(4)
    x, _ = inputs(7)
    ref = nn.MultiHeadDotProductAttention(num_heads=HQ, qkv_features=HQ * D)
    ours = nn.MultiHeadDotProductAttention(num_heads=HQ, qkv_features=HQ * D,
                                           attention_fn=make_attention_fn(mesh, causal=True))
    params = jax.jit(ref.init)(jax.random.key(0), x)
    causal_mask = nn.make_causal_mask(jnp.zeros((B, S)))

    def loss(module, mask):
        return lambda p: jnp.sum(jnp.sin(module.apply(p, x, mask=mask)))

    lr, gr = jax.jit(jax.value_and_grad(loss(ref, causal_mask)))(params)
    lo, go = jax.jit(jax.value_and_grad(loss(ours, None)))(params)
    assert_close(lo, lr, TOL, "loss")
    chex.assert_trees_all_equal_shapes_and_dtypes(go, gr)
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(go)[0],
                                 jax.tree_util.tree_flatten_with_path(gr)[0]):
        name = jax.tree_util.keystr(path)
        if "'key']['bias'" in name:  # softmax ignores a shift shared by all keys: dB = 0
            assert float(jnp.abs(a).max()) < 1e-5 and float(jnp.abs(b).max()) < 1e-5, name
        else:
            assert_close(a, b, TOL, f"d{name}")


def test_attention_fn_in_nnx_multihead_attention():
    mesh = auto_mesh(8)
    x, _ = inputs(9)
    kw = dict(num_heads=HQ, in_features=DM, qkv_features=HQ * D, decode=False)
    ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=make_attention_fn(mesh, layout="zigzag"),
                                  rngs=nnx.Rngs(0))
    out_ref = ref(x, is_causal=True)
    out = jax.jit(lambda x: ours(x, is_causal=True))(x)
    assert_close(out, out_ref, TOL, "nnx MultiHeadAttention, is_causal")
    assert_close(jax.jit(lambda x: ours(x))(x), ref(x), TOL, "nnx MultiHeadAttention, dense")


def test_attention_fn_refuses_what_it_cannot_honour():
    fn = make_attention_fn(auto_mesh(2), causal=True)
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(NotImplementedError, match="mask="):
        fn(q, q, q, mask=jnp.ones((1, 1, 16, 16), bool))
    with pytest.raises(NotImplementedError, match="bias="):
        fn(q, q, q, bias=jnp.zeros((1, 1, 16, 16)))
    with pytest.raises(NotImplementedError, match="dropout_rate"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(NotImplementedError, match="cross-attention"):
        fn(q, jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 8, 2, 8)))
    with pytest.raises(NotImplementedError, match="precision="):
        fn(q, q, q, precision=jax.lax.Precision.HIGHEST)
    fn(q, q, q, dropout_rate=0.1, deterministic=True)  # no dropout happens: accepted
    mha = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn, dropout_rate=0.1,
                                          deterministic=False)
    x = jnp.zeros((1, 16, 16))
    with pytest.raises(NotImplementedError, match="dropout_rate"):
        mha.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)


# ------------------------------------------------------------------ errors
def test_layer_errors_name_the_argument():
    explicit = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2],
                             axis_types=(AxisType.Explicit,))
    with pytest.raises(ValueError, match="AxisType.Auto"):
        SeqParallelOptions(mesh=explicit)
    with pytest.raises(ValueError, match="axis_name='seq'"):
        SeqParallelOptions(mesh=auto_mesh(2), axis_name="seq")
    with pytest.raises(ValueError, match="seq_selective"):
        SeqParallelOptions(seq_selective=True)
    with pytest.raises(ValueError, match="layout"):
        SeqParallelOptions(mesh=auto_mesh(2), layout="spiral")
    with pytest.raises(ValueError, match="num_kv_heads"):
        SeqParallelAttention(num_heads=4, head_dim=8, num_kv_heads=3).init(
            jax.random.key(0), jnp.zeros((1, 8, 16)))
    with pytest.raises(ValueError, match="even head_dim"):
        SeqParallelAttention(num_heads=2, head_dim=7).init(jax.random.key(0),
                                                           jnp.zeros((1, 8, 16)))
    with pytest.raises(ValueError, match="positions must have shape"):
        apply_rope(jnp.zeros((1, 8, 2, 4)), np.arange(7))
