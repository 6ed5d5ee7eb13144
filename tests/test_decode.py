"""Issue 5 (part): tree_decode, ring_decode, allgather_decode."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.runtime.comm import collective_bytes

F32, BF16 = jnp.float32, jnp.bfloat16
DECODERS = {"tree": jsp.tree_decode, "ring": jsp.ring_decode, "allgather": jsp.allgather_decode}


@functools.partial(jax.jit, static_argnames="causal")
def _reference_row(q, k, v, do, length, causal):
    """One batch row (float32): the dense reference on the first ``length`` keys of the
    cache, output and gradients.  Keys past ``length`` are masked (segment 0 against the
    queries' segment 1) rather than sliced off, so every row and case of one shape shares
    one compiled program; a row with ``length = 0`` sees nothing and gives zeros."""
    Tq, S = q.shape[1], k.shape[1]
    q_pos = length - Tq + jnp.arange(Tq) if causal else jnp.arange(Tq)
    kv_seg = (jnp.arange(S) < length).astype(jnp.int32)[None]

    def f(q, k, v):
        return jsp.reference_attention(q, k, v, causal=causal, q_pos=q_pos,
                                       kv_pos=jnp.arange(S), kv_segment_ids=kv_seg,
                                       segment_ids=jnp.ones((1, Tq), jnp.int32))[0]

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)


def _reference(q, k, v, lengths, causal, do=None):
    """Per batch row: the dense reference on the valid prefix of the cache (float32)."""
    up = lambda x: x.astype(F32)  # noqa: E731
    q, k, v = up(q), up(k), up(v)
    do_ = jnp.zeros_like(q) if do is None else up(do)
    rows = [_reference_row(q[b:b + 1], k[b:b + 1], v[b:b + 1], do_[b:b + 1],
                           jnp.int32(lengths[b]), causal) for b in range(q.shape[0])]
    out = jnp.concatenate([r[0] for r in rows])
    if do is None:
        return out
    return out, tuple(jnp.concatenate([r[1][i] for r in rows]) for i in range(3))


@functools.lru_cache(maxsize=None)
def _jitted(name, G, causal):
    mesh = helpers.make_mesh(G)
    return jax.jit(lambda q, k, v, L: DECODERS[name](q, k, v, mesh=mesh, kv_lengths=L,
                                                     causal=causal))


def _inputs(seed, B, Tq, S=64, Hq=4, Hkv=2, D=16, dtype=F32):
    q, k, v = helpers.make_qkv(seed, B=B, S=Tq, Sk=S, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    return q, k, v


CASES = [  # G, B, Tq, causal, dtype, lengths
    (1, 1, 1, False, F32, [64]),
    (2, 3, 4, True, F32, [64, 9, 40]),
    (4, 3, 1, True, F32, [64, 5, 33]),      # length 5: three of four shards empty
    (8, 1, 4, False, F32, [50]),
    (8, 3, 4, True, BF16, [64, 4, 23]),
    (4, 1, 4, False, BF16, [64]),
]


@pytest.mark.parametrize("name", sorted(DECODERS))
@pytest.mark.parametrize("G,B,Tq,causal,dtype,lengths", CASES)
def test_decoders_match_reference(name, G, B, Tq, causal, dtype, lengths):
    q, k, v = _inputs(G + B + Tq, B, Tq, dtype=dtype)
    L = jnp.asarray(lengths, jnp.int32)
    out = _jitted(name, G, causal)(q, k, v, L)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, q)
    helpers.assert_close(out, _reference(q, k, v, lengths, causal), helpers.tol(dtype), name)


class TestJitVariants(chex.TestCase):
    """``tree_decode`` works with and without ``jit`` (ragged lengths, causal, GQA)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_tree_decode(self):
        q, k, v = _inputs(31, 2, 2)
        lengths = [64, 21]
        mesh = helpers.make_mesh(4)
        out = self.variant(lambda q, k, v, L: jsp.tree_decode(
            q, k, v, mesh=mesh, kv_lengths=L, causal=True))(q, k, v,
                                                            jnp.asarray(lengths, jnp.int32))
        chex.assert_trees_all_equal_shapes_and_dtypes(out, q)
        helpers.assert_close(out, _reference(q, k, v, lengths, True), 1e-5,
                             f"tree_decode {self.variant.type}")


@pytest.mark.parametrize("G,B,Tq,causal", [(1, 1, 1, True), (4, 3, 4, True), (8, 3, 1, False)])
def test_tree_decode_gradients(G, B, Tq, causal):
    lengths = [64, 17, 3][:B]
    q, k, v = _inputs(7 + G, B, Tq)
    do = helpers.make_cotangent(7 + G, q.shape)
    mesh = helpers.make_mesh(G)
    L = jnp.asarray(lengths, jnp.int32)
    _, vjp = jax.vjp(lambda q, k, v: jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=L,
                                                     causal=causal), q, k, v)
    grads = vjp(do)
    _, ref = _reference(q, k, v, lengths, causal, do)
    for n, g, r in zip(("dq", "dk", "dv"), grads, ref):
        helpers.assert_close(g, r, 1e-5, n)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_auto_uses_the_decode_kernel_and_xla_agrees(name, monkeypatch):
    from jax_seqpar.kernels.xla_decode import XlaDecodeKernel

    calls = []
    inner = XlaDecodeKernel._fwd

    def counting(self, *args):
        calls.append(args[0].shape)
        return inner(self, *args)

    monkeypatch.setattr(XlaDecodeKernel, "_fwd", counting)
    q, k, v = _inputs(21, 2, 4)
    L = jnp.asarray([64, 30], jnp.int32)
    mesh = helpers.make_mesh(4)
    auto = DECODERS[name](q, k, v, mesh=mesh, kv_lengths=L, causal=True)
    assert calls, "kernel='auto' did not run XlaDecodeKernel"
    calls.clear()
    xla = DECODERS[name](q, k, v, mesh=mesh, kv_lengths=L, causal=True, kernel="xla")
    assert not calls
    helpers.assert_close(auto, xla, 1e-5, f"{name}: auto vs xla")
    helpers.assert_close(auto, _reference(q, k, v, [64, 30], True), 1e-5, name)


def test_auto_kernel_choice_by_platform(monkeypatch):
    import jax_seqpar.decode as dec

    q128 = jnp.zeros((1, 1, 8, 128), BF16)
    q32 = jnp.zeros((1, 1, 8, 32), BF16)
    assert dec.decode_kernel_name("auto", q128) == "xla_decode"  # on this CPU
    assert dec.decode_kernel_name("xla", q128) == "xla"
    monkeypatch.setattr(dec, "default_platform", lambda: "gpu")
    assert dec.decode_kernel_name("auto", q128) == "pallas_decode"
    assert dec.decode_kernel_name("auto", q32) == "xla_decode"  # head dim it refuses


def test_tree_decode_with_jax_nn_and_large_scores():
    q, k, v = helpers.make_large_qkv(3, B=2, S=4, Sk=64)
    mesh = helpers.make_mesh(8)
    out = jsp.tree_decode(q, k, v, mesh=mesh)
    want = jax.nn.dot_product_attention(q, k, v, implementation="xla")
    assert helpers.max_abs_score(q, k) > 500
    helpers.assert_close(out, want, 1e-5, "tree vs jax.nn")


def test_length_zero_gives_zeros():
    q, k, v = _inputs(11, 2, 1)
    out = jsp.tree_decode(q, k, v, mesh=helpers.make_mesh(4),
                          kv_lengths=jnp.asarray([0, 64], jnp.int32))
    chex.assert_tree_all_finite(out)
    assert np.all(np.asarray(out[0]) == 0)


@pytest.mark.parametrize("G", [2, 4, 8])
def test_tree_bytes_follow_eq14(G):
    """One pmax of lse and one fused psum of [numerator, denominator], each
    2 (G - 1) / G of its size per device (Tree Attention Eq. 14)."""
    B, Tq, Hq, D = 3, 4, 4, 16
    q, k, v = _inputs(2, B, Tq, Hq=Hq, D=D)
    mesh = helpers.make_mesh(G)
    rep = collective_bytes(lambda q, k, v: jsp.tree_decode(q, k, v, mesh=mesh), q, k, v)
    assert rep.count_by_kind() == {"all-reduce": 2}
    numel = B * Tq * Hq * (D + 1) + B * Hq * Tq
    assert rep.total_bytes == round(2 * (G - 1) / G * numel * 4)


@pytest.mark.parametrize("G", [2, 4])
def test_ring_decode_bytes_follow_eq10(G):
    B, S, Hkv, D = 1, 64, 2, 16
    q, k, v = _inputs(3, B, 1, S=S, Hkv=Hkv, D=D)
    mesh = helpers.make_mesh(G)
    rep = collective_bytes(lambda q, k, v: jsp.ring_decode(q, k, v, mesh=mesh), q, k, v)
    assert rep.total_bytes == (G - 1) * 2 * B * (S // G) * Hkv * D * 4


def test_two_dimensional_mesh_matches_one_dimensional():
    q, k, v = _inputs(5, 3, 4)
    L = jnp.asarray([64, 30, 9], jnp.int32)
    mesh2 = jax.make_mesh((2, 4), ("node", "gpu"))
    out2 = jsp.tree_decode(q, k, v, mesh=mesh2, axis_name=("node", "gpu"), kv_lengths=L,
                           causal=True)
    out1 = jsp.tree_decode(q, k, v, mesh=helpers.make_mesh(8), kv_lengths=L, causal=True)
    chex.assert_trees_all_close(out2, out1, rtol=1e-6, atol=1e-6)


def test_decode_errors():
    q, k, v = _inputs(1, 2, 1)
    mesh = helpers.make_mesh(4)
    with pytest.raises(ValueError, match="kv_lengths"):
        jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=jnp.ones((3,), jnp.int32))
    with pytest.raises(TypeError, match="kv_lengths"):
        jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="divisible"):
        jsp.tree_decode(q, k[:, :62], v[:, :62], mesh=mesh)
    with pytest.raises(ValueError, match="axis_name"):
        jsp.tree_decode(q, k, v, mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match="multiple"):
        jsp.tree_decode(q[:, :, :3], k, v, mesh=mesh)
