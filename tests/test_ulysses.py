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
from jax_seqpar.runtime import comm
from jax_seqpar.runtime.comm import collective_bytes, op_axes
from jax_seqpar.parallel.costs import AttnShape, bytes_per_axis

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
    (4, 8, 4, True, None, "zigzag", True, F32),
    (4, 4, 4, False, (7, 2), "zigzag", False, BF16),
    (8, 8, 8, True, (9, 0), "contiguous", True, F32),
    (8, 16, 8, True, None, "zigzag", False, F32),
]


@pytest.mark.parametrize("G,Hq,Hkv,causal,window,layout,with_seg,dtype", ULYSSES_CASES)
def test_ulysses_matches_reference(G, Hq, Hkv, causal, window, layout, with_seg, dtype):
    _check("ulysses", G, Hq, Hkv, causal, window, layout, with_seg, dtype)


USP_CASES = [  # ((No, Ni), Hq, Hkv, backward, layout, segments, dtype)
    ((2, 4), 8, 4, "kv", "zigzag", True, F32),
    ((4, 2), 4, 2, "kv", "zigzag", False, BF16),
    ((4, 2), 8, 2, "q", "zigzag", True, F32),
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


# ------------------------------------------------------------------ bytes per mesh axis
def _reports(strategy, G, Hq, Hkv, backward, with_seg, S_=S):
    """Forward and backward ``CommReport``s of one call (float32: the CPU backend sends
    bf16 collectives as f32).  No mask (a causal mask sends the same bytes,
    ``test_burst.test_causal_does_not_change_traffic``, and compiles slower) and the
    contiguous layout, so that only the attention's own collectives are counted."""
    q, k, v = helpers.make_qkv(2, B=B, S=S_, Hq=Hq, Hkv=Hkv, D=D)
    do = helpers.make_cotangent(2, q.shape)
    seg = helpers.sorted_segments(3, B, S_) if with_seg else None
    mesh, axis = _mesh(G), _axis(G)

    def att(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, axis_name=axis, strategy=strategy,
                             segment_ids=seg, backward=backward)

    fwd = collective_bytes(att, q, k, v)
    _, vjp = jax.vjp(att, q, k, v)
    bwd = collective_bytes(jax.jit(lambda vjp, do: vjp(do)), vjp, do)
    shape = AttnShape(B, S_, Hq, Hkv, D, 4, with_seg)
    axes = dict(zip(("outer", "inner"), G)) if isinstance(G, tuple) else {"sp": G}
    return mesh, fwd, bwd, bytes_per_axis(strategy, shape, axes, backward=backward)


@pytest.mark.parametrize("G,Hq,Hkv,with_seg", [(2, 8, 2, True), (8, 8, 8, False)])
def test_ulysses_bytes_per_axis(G, Hq, Hkv, with_seg):
    mesh, fwd, bwd, want = _reports("ulysses", G, Hq, Hkv, "kv", with_seg)
    assert fwd.bytes_by_axis(mesh) == want["forward"]
    assert bwd.bytes_by_axis(mesh) == want["backward"]
    assert fwd.count_by_kind()["all-to-all"] == 4          # q, k, v in; o out
    assert bwd.count_by_kind() == {"all-to-all": 4}        # dO in; dq, dk, dv out
    T = S // G
    assert want["backward"]["sp"] == (G - 1) * B * T * (2 * Hq + 2 * Hkv) * D * 4 // G


@pytest.mark.parametrize("G,Hq,Hkv,backward,with_seg", [((4, 2), 4, 2, "q", True)])
def test_usp_bytes_per_axis(G, Hq, Hkv, backward, with_seg):
    mesh, fwd, bwd, want = _reports("usp", G, Hq, Hkv, backward, with_seg)
    assert fwd.bytes_by_axis(mesh) == want["forward"]
    assert bwd.bytes_by_axis(mesh) == want["backward"]
    assert set(want["forward"]) == {"outer", "inner"} and all(want["forward"].values())
    # all-to-alls only on the inner axis, ring hops only on the outer one
    for rep in (fwd, bwd):
        for op in rep.ops:
            assert op_axes(op, mesh) == ("inner" if op.kind in ("all-to-all", "all-gather")
                                         else "outer"), op


def test_op_axes_reads_every_replica_group_spelling():
    a2a = "%x = f32[4] all-to-all(%y), replica_groups={{0,1},{2,3},{4,5},{6,7}}"
    iota = "%x = f32[4] all-reduce(%y), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add"
    meshf = ("%x = f32[4] all-gather(%y), replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, "
             "dimensions={0}")
    perm = "%x = f32[4] collective-permute(%y), source_target_pairs={{0,2},{2,0},{5,7}}"
    mesh = {"outer": 2, "mid": 2, "inner": 2}
    got = []
    for line in (a2a, iota, meshf, perm):
        groups = comm._replica_groups(line, 8)
        got.append(op_axes(comm.CollectiveOp("x", "x", "c", 4, 2, 1, 4.0, groups), mesh))
    assert got == ["inner", ("outer", "mid"), ("outer", "inner"), "mid"]
    assert comm._replica_groups(iota, 8) == ((0, 2, 4, 6), (1, 3, 5, 7))


@pytest.mark.parametrize("strategy", ["allgather", "tree"])
def test_one_axis_strategies_bytes_per_axis(strategy):
    """The per-axis formulas of the older strategies, forward and backward, at G=4."""
    mesh, fwd, bwd, want = _reports(strategy, 4, 4, 2, "kv", True)
    assert fwd.bytes_by_axis(mesh) == want["forward"]
    assert bwd.bytes_by_axis(mesh) == want["backward"]
