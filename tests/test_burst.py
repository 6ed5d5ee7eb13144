"""Issue 3: BurstAttention backward (backward="q"), "auto", and their exact traffic."""

import functools

import jax
import jax.numpy as jnp
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.parallel.costs import RingShape, backward_bytes, choose_backward

F32, BF16 = jnp.float32, jnp.bfloat16


@functools.lru_cache(maxsize=None)
def _grad_fn(G, backward, causal, window, with_seg):
    mesh = helpers.make_mesh(G)

    def f(q, k, v, do, seg):
        def att(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, causal=causal, window=window,
                                 segment_ids=seg if with_seg else None, backward=backward)
        out, vjp = jax.vjp(att, q, k, v)
        return out, vjp(do)

    return jax.jit(f)


#: Both schemes (and "auto") on the largest ring, where they differ most: multi-query
#: attention with packed documents (auto -> "kv") and a two-sided window in bf16
#: (auto -> "q").  Each scheme is checked against the reference at every ring size, causal
#: and not, in tests/test_attention.py (test_basic), with GQA/MQA, windows, segments, bf16
#: and large scores (test_targeted, test_combined) and with every layout and mask
#: (tests/test_layouts.py, bf16 included); this test adds that the two agree with each
#: other and that "auto" picks a scheme that computes the same gradients.
CASES = [  # (G, Hq, Hkv, causal, window, segments, dtype)
    (8, 4, 1, True, None, True, F32),
    (8, 4, 4, False, (5, 3), False, BF16),
]


@pytest.mark.parametrize("G,Hq,Hkv,causal,window,with_seg,dtype", CASES)
def test_backward_schemes_match_reference(G, Hq, Hkv, causal, window, with_seg, dtype):
    B, S, D = 2, 64, 16
    q, k, v = helpers.make_qkv(G + Hkv, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    do = helpers.make_cotangent(G, q.shape, dtype)
    seg = helpers.sorted_segments(G, B, S) if with_seg else jnp.zeros((B, S), jnp.int32)
    _, _, ref = helpers.reference_fwd_bwd(q, k, v, do, seg if with_seg else None,
                                          causal=causal, window=window)
    tol = helpers.tol(dtype)
    grads = {}
    # "auto" resolves to one of the two (test_auto_sends_the_smaller_volume checks which)
    for backward in ("kv", "q", "auto"):
        _, grads[backward] = _grad_fn(G, backward, causal, window, with_seg)(q, k, v, do, seg)
        for name, g, r in zip(("dq", "dk", "dv"), grads[backward], ref):
            assert g.dtype == dtype
            helpers.assert_close(g, r, tol, f"backward={backward} {name}")
    # the two schemes are two orders of the same sums: equal to rounding
    for a, b in zip(grads["q"], grads["kv"]):
        assert helpers.rel_err(a, b) <= tol


@functools.lru_cache(maxsize=None)
def _backward_report(G, Hq, Hkv, backward, causal=False, B=2, S=64, D=16):
    """Bytes of the compiled backward (cached: several tests read the same program)."""
    q, k, v = helpers.make_qkv(3, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    do = helpers.make_cotangent(3, q.shape)
    mesh = helpers.make_mesh(G)
    f = lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=causal,  # noqa: E731
                                      backward=backward)
    _, vjp = jax.vjp(f, q, k, v)
    rep = collective_bytes(jax.jit(lambda vjp, do: vjp(do)), vjp, do)
    shape = RingShape(G, B, S // G, Hq, Hkv, D, 4)
    return rep, shape


@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("backward", ["kv", "q"])
def test_backward_bytes_equal_formula(G, Hq, Hkv, backward):
    rep, shape = _backward_report(G, Hq, Hkv, backward)
    assert set(rep.bytes_by_kind()) <= {"collective-permute"}
    assert rep.total_bytes == backward_bytes(backward, shape)


def test_causal_does_not_change_traffic():
    rep, shape = _backward_report(4, 4, 4, "q", causal=True)
    assert rep.total_bytes == backward_bytes("q", shape)


def test_burst_moves_about_a_quarter_less_for_mha():
    """3*D + 2 vs 4*D elements per token and head (float32, so bytes scale alike)."""
    G, D = 8, 128
    kv = _backward_report(G, 2, 2, "kv", S=64, D=D)[0].total_bytes
    q = _backward_report(G, 2, 2, "q", S=64, D=D)[0].total_bytes
    ratio = q / kv
    # (G-1)(2D+2) + D  over  (G-1)(2D) + (G-1)(2D) + ... (f32): 0.753 at G=8, D=128
    assert 0.72 < ratio < 0.78, ratio


def test_gqa_group_four_prefers_kv():
    kv = _backward_report(4, 8, 2, "kv")[0].total_bytes
    q = _backward_report(4, 8, 2, "q")[0].total_bytes
    assert kv < q


@pytest.mark.parametrize("Hq,Hkv,want", [(8, 8, "q"), (8, 4, "kv"), (8, 2, "kv"), (8, 1, "kv")])
def test_choose_backward(Hq, Hkv, want):
    s = RingShape(4, 1, 1024, Hq, Hkv, 128, 2)
    c = choose_backward(s, link_bytes_per_s=124e9)
    assert c.scheme == want
    assert c.kv_bytes == backward_bytes("kv", s) and c.q_bytes == backward_bytes("q", s)
    assert want in c.reason and "GB/s" in c.reason


def test_auto_sends_the_smaller_volume():
    for Hq, Hkv in ((4, 4), (8, 2)):
        auto, shape = _backward_report(4, Hq, Hkv, "auto")
        assert auto.total_bytes == min(backward_bytes("kv", shape), backward_bytes("q", shape))


def test_formula_arguments_are_validated():
    with pytest.raises(ValueError, match="kv_heads"):
        RingShape(2, 1, 8, 6, 4, 16, 2)
    with pytest.raises(ValueError, match="tokens"):
        RingShape(2, 1, 0, 4, 4, 16, 2)
    with pytest.raises(ValueError, match="scheme"):
        backward_bytes("dq", RingShape(2, 1, 8, 4, 4, 16, 2))
