"""Shared test helpers: error metric, meshes, random inputs, oracles.

Everything that compiles is cached (``functools.lru_cache`` around ``jax.jit``), so that
tests sharing a configuration share the compiled executable.
"""

from __future__ import annotations

import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar import reference_attention

F32 = jnp.float32
BF16 = jnp.bfloat16

#: Relative (norm-wise) error budgets (docs/ARCHITECTURE.md, "Numerics").
TOL = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 2e-2}


#: Multiplies the time limits of the tests that start processes: scripts/stress_multiprocess.py
#: runs many copies at once on a few cores, where everything is that much slower; a run
#: that outlives the scaled limit is then stuck, not slow.
TIME_SCALE = float(os.environ.get("JAX_SEQPAR_TEST_TIME_SCALE", "1"))


def seconds(s: float) -> float:
    """A time limit of ``s`` seconds, scaled by ``TIME_SCALE``."""
    return s * TIME_SCALE


def tol(dtype) -> float:
    return TOL[jnp.dtype(dtype)]


# --------------------------------------------------------------------------- metrics
def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` with float32 norms (inf/nan if either has non-finite values)."""
    a, b = to_np32(a), to_np32(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def to_np32(x) -> np.ndarray:
    """Host float32 copy (works for sharded arrays of any dtype)."""
    return np.asarray(jax.device_get(x)).astype(np.float32)


def assert_close(actual, expected, tol_, what="array"):
    """Shapes equal, ``actual`` finite, norm-wise relative error within ``tol_``.

    The budgets (docs/ARCHITECTURE.md, "Numerics") are norm-wise (``rel_err``), not
    elementwise, so only the shape and finiteness checks are chex's.
    """
    actual, expected = to_np32(actual), to_np32(expected)
    chex.assert_equal_shape([actual, expected], custom_message=what)
    chex.assert_tree_all_finite(actual, custom_message=what)
    assert np.linalg.norm(expected.ravel()) > 0, \
        f"{what}: the expected value is all zeros; the comparison would be vacuous"
    err = rel_err(actual, expected)
    assert err <= tol_, f"{what}: relative error {err:.3e} > {tol_:.1e}"
    return err


def assert_trees_close(actual, expected, tol_, what="tree"):
    """Same tree structure and leaf shapes (chex), every leaf within ``tol_`` (``rel_err``)."""
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_equal_shapes(actual, expected)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                            jax.tree_util.tree_leaves(expected)):
        assert_close(a, b, tol_, f"{what}: {jax.tree_util.keystr(path)}")


def assert_lse_close(actual, expected, tol_, what="lse"):
    """lse: the same entries are -inf, the finite ones agree norm-wise."""
    actual, expected = to_np32(actual), to_np32(expected)
    chex.assert_equal_shape([actual, expected], custom_message=what)
    assert not np.isnan(actual).any(), f"{what} has NaN"
    assert not np.isposinf(actual).any(), f"{what} has +inf"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected),
                                  err_msg=f"{what}: -inf pattern differs")
    fin = np.isfinite(expected)
    assert fin.any()
    err = rel_err(actual[fin], expected[fin])
    assert err <= tol_, f"{what}: relative error {err:.3e} > {tol_:.1e}"


# --------------------------------------------------------------------------- meshes
def make_mesh(G: int):
    """1-D mesh over the first ``G`` devices, axis ``"sp"`` (``jax.make_mesh``'s axis types)."""
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])


# --------------------------------------------------------------------------- inputs
_POOL = 1 << 16  # values per array; every test shape fits


@jax.jit
def _normal_pool(seed):
    """Four independent standard-normal vectors (one compilation for every test shape)."""
    return jax.random.normal(jax.random.key(seed, impl="rbg"), (4, _POOL), F32)


def _draw(seed, shapes, dtype, scales):
    pool = np.asarray(_normal_pool(seed))
    out = []
    for i, (shp, sc) in enumerate(zip(shapes, scales)):
        n = int(np.prod(shp))
        assert n <= _POOL, shp
        x = pool[i, :n].reshape(shp) * np.float32(sc)
        out.append(jnp.asarray(x.astype(jnp.dtype(dtype))))
    return tuple(out)


def make_qkv(seed, *, B=2, S=64, Hq=4, Hkv=4, D=16, Sk=None, dtype=F32, qk_scale=1.0):
    """Random normal (``jax.random.normal``) q ``[B, S, Hq, D]``, k, v ``[B, Sk, Hkv, D]``.

    ``qk_scale`` multiplies q and k (scores then scale by ``qk_scale**2``).
    """
    Sk = S if Sk is None else Sk
    shapes = ((B, S, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D))
    return _draw(seed, shapes, dtype, (qk_scale, qk_scale, 1.0))


def make_cotangent(seed, shape, dtype=F32):
    return _draw(seed + 10_000, (tuple(shape),), dtype, (1.0,))[0]


#: q/k scale that makes scores (with the default 1/sqrt(D) scale) about N(0, 300^2), so
#: the extreme scores of a test-sized problem are about +-1e3.
LARGE_QK_SCALE = 300.0 ** 0.5


def make_large_qkv(seed, *, B=2, S=64, Hq=4, Hkv=4, D=16, Sk=None, dtype=F32):
    """Large-magnitude inputs whose scores are *exact* in float32: q, k integer-valued in
    [-25, 25] (exact in bf16 too), default scale 1/sqrt(16) = 1/4, so every score is a
    multiple of 1/4 with |score| up to about 1e3; v is standard normal.

    Exact scores remove the part of the error that no float32 implementation avoids
    (rounding a score of 1e3 moves it by ~6e-5, which moves softmax weights by the same
    relative amount), so the comparison isolates what the implementation does with them.
    """
    assert D == 16, "the exactness argument needs scale = 1/4"
    Sk = S if Sk is None else Sk
    rng = np.random.default_rng(seed)
    q = rng.integers(-25, 26, size=(B, S, Hq, D)).astype(np.float32)
    k = rng.integers(-25, 26, size=(B, Sk, Hkv, D)).astype(np.float32)
    _, _, v = make_qkv(seed, B=B, S=S, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    cast = lambda x: jnp.asarray(x.astype(jnp.dtype(dtype)))  # noqa: E731
    return cast(q), cast(k), v


def max_abs_score(q, k, scale=None):
    """max |scale * q.k| over all (query head, key head) pairs (host float64)."""
    q, k = to_np32(q).astype(np.float64), to_np32(k).astype(np.float64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return float(np.abs(np.einsum("bqhd,bkgd->bhgqk", q, k)).max() * scale)


def conditioning_tol(base, max_score):
    """Budget for gradients compared across *different* float32 algorithms at large scores.

    A float32 score ``s`` (and a row's lse) carries a rounding error of about
    ``|s| * 2**-24``, and a softmax gradient is as sensitive in relative terms as its
    scores are in absolute terms, so no float32 implementation does better: at scores of
    ~1e3, even ``jax.nn.dot_product_attention`` is 1-2e-5 away from a float64 dQ, and
    backwards that recompute P from the saved lse (FlashAttention-2 style, like the
    kernel and the reference) 2-4e-5.  Two ulps of the largest score, floored at ``base``.
    """
    return max(base, 2 * 2.0 ** -24 * max_score)


def sorted_segments(seed, B, S, num_docs=4):
    """Ragged packed documents: sorted ids, random document lengths (>= 1 token each)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), size=num_docs - 1, replace=False))
        ids = np.zeros(S, np.int32)
        for c in cuts:
            ids[c:] += 1
        out.append(ids)
    return jnp.asarray(np.stack(out))


def unsorted_segments(seed, B, S, num_ids=3):
    """Unsorted ids: every token gets a random id (documents interleave)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, num_ids, size=(B, S)).astype(np.int32))


# --------------------------------------------------------------------------- oracles
def _f32(*xs):
    return tuple(None if x is None else jnp.asarray(x).astype(F32) for x in xs)


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "block_mask"))
def reference_fwd_bwd(q, k, v, do, segment_ids=None, kv_segment_ids=None, q_pos=None,
                      kv_pos=None, *, causal=False, window=None, scale=None, block_mask=None):
    """``reference_attention`` on float32 upcasts: ``(out, lse, (dq, dk, dv))``.

    ``block_mask``, if given, must be a (hashable) ``jax_seqpar.masks.BlockMask``.
    """
    q, k, v, do = _f32(q, k, v, do)
    extra = {} if block_mask is None else {"block_mask": block_mask}

    def f(q, k, v):
        return reference_attention(q, k, v, causal=causal, window=window,
                                   segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                   q_pos=q_pos, kv_pos=kv_pos, scale=scale, **extra)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads = vjp((do, jnp.zeros_like(lse)))
    return out, lse, grads


def segment_mask(segment_ids, kv_segment_ids=None):
    """Boolean ``[B, 1, T, S]`` mask for ``jax.nn.dot_product_attention``."""
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    return (segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale"))
def jax_nn_fwd_bwd(q, k, v, do, segment_ids=None, *, causal=False, window=None, scale=None):
    """``jax.nn.dot_product_attention(implementation="xla")`` on float32 upcasts."""
    q, k, v, do = _f32(q, k, v, do)
    mask = None if segment_ids is None else segment_mask(segment_ids)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                            local_window_size=window, scale=scale,
                                            implementation="xla")

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)


# --------------------------------------------- stand-ins for GPU-only backends on CPU
def index_masked_scores(q, k, scale, ok):
    """Scaled scores ``[B, Hq, Tq, Tk]`` in float32 (GQA by repeating K), ``-inf`` where
    the boolean ``ok [Tq, Tk]`` is False: a backend that masks by local index."""
    g = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32),
                   jnp.repeat(k.astype(F32), g, axis=2)) * scale
    return jnp.where(ok, s, -jnp.inf)


def probs_times_v(p, v):
    """``P V`` in float32, ``[B, Tq, Hq, D]`` (GQA by repeating V)."""
    g = p.shape[1] // v.shape[2]
    return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v.astype(F32), g, axis=2))


def backward_from_probs(q, k, v, o, p, do, scale):
    """FlashAttention-2's backward from the probabilities ``p`` and the *given* output
    ``o`` (``delta = rowsum(dO * O)``), as cuDNN's and tokamax's primitives compute it;
    ``(dq, dk, dv)`` in the input dtypes."""
    B, Tk, Hkv, D = k.shape
    g = q.shape[2] // Hkv
    dof = do.astype(F32)
    delta = jnp.einsum("bqhd,bqhd->bhq", dof, o.astype(F32))
    dp = jnp.einsum("bqhd,bkhd->bhqk", dof, jnp.repeat(v.astype(F32), g, axis=2))
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k.astype(F32), g, axis=2))
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(F32)).reshape(B, Tk, Hkv, g, D).sum(3)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, dof).reshape(B, Tk, Hkv, g, D).sum(3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.lru_cache(maxsize=None)
def ring_fwd_bwd(G, causal, layout, backward, window, kernel):
    """Jitted ``(q, k, v, do) -> (out, (dq, dk, dv))`` of ``jsp.attention`` on ``G``
    devices with ``kernel``."""
    import jax_seqpar as jsp
    mesh = make_mesh(G)

    def f(q, k, v, do):
        att = lambda q, k, v: jsp.attention(  # noqa: E731
            q, k, v, mesh=mesh, causal=causal, layout=layout, backward=backward,
            window=window, kernel=kernel)
        out, vjp = jax.vjp(att, q, k, v)
        return out, vjp(do)

    return jax.jit(f)
