"""Global ``jax_seqpar.attention``: outputs and gradients against two oracles.

Every case is compared with ``reference_attention`` (float32, dense) and, independently,
with ``jax.nn.dot_product_attention(implementation="xla")``, on 1, 2, 4 and 8 simulated
devices, for both strategies.  bf16 inputs are compared with the oracles evaluated on the
same bf16 values upcast to float32.
"""

import functools
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_seqpar as jsp
from helpers import (BF16, F32, assert_close, conditioning_tol,
                     jax_nn_fwd_bwd, make_cotangent, make_large_qkv, make_mesh, make_qkv,
                     max_abs_score, reference_fwd_bwd, sorted_segments, to_np32, tol,
                     unsorted_segments)
from jax_seqpar.kernels import XlaKernel
from jax_seqpar.masks import BlockMask

B, S, HQ, D = 2, 64, 4, 16
GS = (1, 2, 4, 8)
#: (strategy, backward): both ring backward schemes, and the all-gather baseline.
VARIANTS = {"ring_kv": ("ring", "kv"), "ring_q": ("ring", "q"), "allgather": ("allgather", "auto"),
            "tree": ("tree", "auto")}


@functools.lru_cache(maxsize=None)
def attention_fwd_bwd(mesh, strategy, causal, window, axis_name="sp", **kw):
    """Jitted ``(q, k, v, do, seg) -> (out, (dq, dk, dv))`` through ``jsp.attention``."""

    def f(q, k, v, do, seg):
        def att(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, axis_name=axis_name, strategy=strategy,
                                 causal=causal, window=window, segment_ids=seg, **kw)

        out, vjp = jax.vjp(att, q, k, v)
        return out, vjp(do)

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def cached_mesh(G):
    return make_mesh(G)


def check(out, grads, q, k, v, do, seg, *, causal, window, scale=None, large=False,
          jax_nn=True):
    """Compare ``out`` and ``grads`` with the reference and with jax.nn."""
    chex.assert_trees_all_equal_shapes_and_dtypes((out, *grads), (q, q, k, v))
    t = tol(q.dtype)
    ro, _, rgrads = reference_fwd_bwd(q, k, v, do, seg, causal=causal, window=window,
                                      scale=scale)
    assert_close(out, ro, t, "out vs reference")
    for nm, g, rg in zip("qkv", grads, rgrads):
        assert_close(g, rg, t, f"d{nm} vs reference")
    if not jax_nn:
        return
    # Different float32 algorithms at scores ~1e3 differ by the scores' own rounding; see
    # helpers.conditioning_tol.  Large inputs here have exact scores, so only the lse
    # rounding of the backward (shared by the kernel and the reference) is left.
    gtol = conditioning_tol(t, max_abs_score(q, k, scale)) if large else t
    jo, jgrads = jax_nn_fwd_bwd(q, k, v, do, seg, causal=causal, window=window, scale=scale)
    assert_close(out, jo, t, "out vs jax.nn")
    for nm, g, jg in zip("qkv", grads, jgrads):
        assert_close(g, jg, gtol, f"d{nm} vs jax.nn")


def run(G, strategy, *, causal=False, window=None, Hkv=HQ, seg=None, dtype=F32,
        large=False, seed=0, S_=S, **kw):
    shape = dict(B=B, S=S_, Hq=HQ, Hkv=Hkv, D=D, dtype=dtype)
    q, k, v = make_large_qkv(seed, **shape) if large else make_qkv(seed, **shape)
    if large:
        assert 500 < max_abs_score(q, k) < 2000
    do = make_cotangent(seed, q.shape, dtype)
    segs = {None: None, "sorted": lambda: sorted_segments(seed, B, S_, num_docs=5),
            "unsorted": lambda: unsorted_segments(seed, B, S_)}
    seg_ids = None if seg is None else segs[seg]()
    fn = attention_fwd_bwd(cached_mesh(G), strategy, causal, window, **kw)
    out, grads = fn(q, k, v, do, seg_ids)
    check(out, grads, q, k, v, do, seg_ids, causal=causal, window=window, large=large,
          scale=kw.get("scale"))
    return out, grads


# ----------------------------------------------------------------------------- grids
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("G", GS)
def test_basic(G, variant, causal):
    strategy, backward = VARIANTS[variant]
    run(G, strategy, causal=causal, backward=backward)


TARGETED = {
    "gqa": dict(Hkv=2, causal=True),
    "mqa": dict(Hkv=1),
    "window_8_0_causal": dict(window=(8, 0), causal=True),
    "window_5_3": dict(window=(5, 3)),
    "segments_sorted_causal": dict(seg="sorted", causal=True, Hkv=2),
    "segments_unsorted": dict(seg="unsorted"),
    "bf16": dict(dtype=BF16, causal=True, Hkv=2),
    "large": dict(large=True, causal=True),
}


#: Every axis runs once under each variant (both ring backwards, all-gather, tree); the ring
#: sizes alternate between the axes so that each axis meets an 8-device ring and a 1- or
#: 2-device one, and each variant keeps the sizes it had (ring_kv 1 and 4, ring_q 2 and 8,
#: all-gather 2 and 8, tree 4 and 8).  test_basic runs every variant at every G.
TARGETED_RUNS = ([(1, "ring_kv"), (8, "ring_q"), (2, "allgather"), (4, "tree")],
                 [(4, "ring_kv"), (2, "ring_q"), (8, "allgather"), (8, "tree")])


@pytest.mark.parametrize("case,G,variant", [
    (case, G, variant) for i, case in enumerate(TARGETED)
    for G, variant in TARGETED_RUNS[i % 2]])
def test_targeted(case, G, variant):
    """Each axis (GQA, MQA, windows, segments, bf16, large scores) under every strategy."""
    strategy, backward = VARIANTS[variant]
    run(G, strategy, backward=backward, **TARGETED[case])


COMBINED = {
    # every mask feature at once; at G=8 each shard is 16 tokens, so most ring steps are
    # skipped by the window and the documents cross shard boundaries
    "all_masks_gqa": dict(causal=True, window=(20, 0), seg="sorted", Hkv=2, S_=128),
    "window_int_mqa_unsorted": dict(window=6, seg="unsorted", Hkv=1),
    "bf16_mqa_window_segments": dict(dtype=BF16, Hkv=1, window=(5, 3), seg="sorted"),
    "bf16_large": dict(dtype=BF16, large=True, Hkv=2),
    "large_window_segments": dict(large=True, window=(9, 4), seg="sorted", Hkv=2),
    "scale": dict(scale=0.11, causal=True),
    "backward_q_gqa_segments": dict(backward="q", causal=True, Hkv=2, seg="unsorted"),
    "backward_kv_mha_window": dict(backward="kv", window=(7, 7)),
    "small_kernel_blocks": dict(kernel=XlaKernel(block_q=5, block_k=3), causal=True,
                                window=(11, 2), Hkv=2),
}


COMBINED_RUNS = [("all_masks_gqa", 2), ("all_masks_gqa", 8),
                 ("window_int_mqa_unsorted", 8), ("bf16_mqa_window_segments", 4),
                 ("bf16_large", 8), ("large_window_segments", 4), ("scale", 2),
                 ("backward_q_gqa_segments", 8), ("backward_kv_mha_window", 4),
                 ("small_kernel_blocks", 2), ("small_kernel_blocks", 8)]


@pytest.mark.parametrize("case,G", COMBINED_RUNS)
def test_combined(case, G):
    """Features together; ring with backward="auto" unless the case says otherwise."""
    run(G, "ring", **COMBINED[case])


@pytest.mark.parametrize("case", ["all_masks_gqa", "bf16_large"])
@pytest.mark.parametrize("strategy", ["allgather", "tree"])
def test_combined_allgather_tree(case, strategy):
    run(4, strategy, **COMBINED[case])


@pytest.mark.parametrize("batch,G", [(1, 2), (3, 4), (3, 8)])
def test_tree_batch_sizes(batch, G):
    """``strategy="tree"`` at batch sizes 1 and 3 (GQA, causal, segments)."""
    q, k, v = make_qkv(21, B=batch, S=S, Hq=HQ, Hkv=2, D=D)
    do = make_cotangent(21, q.shape)
    seg = sorted_segments(21, batch, S, num_docs=3)
    out, grads = attention_fwd_bwd(cached_mesh(G), "tree", True, None)(q, k, v, do, seg)
    check(out, grads, q, k, v, do, seg, causal=True, window=None)


# --------------------------------------------------------- rows without visible keys
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ring_steps_with_no_visible_key(variant):
    """Single-token documents with a causal window: on 8 devices, for most rows every
    ring step but one sees no key (partial lse = -inf), so the merge must ignore them.

    (Rows with *no* visible key at all cannot be built through ``attention``: it is
    self-attention, and a query always sees its own key.  Those are covered at the
    kernel and reference level.)
    """
    q, k, v = make_qkv(11, B=B, S=S, Hq=HQ, Hkv=2, D=D)
    do = make_cotangent(11, q.shape)
    ids = np.arange(S, dtype=np.int32)
    ids[S // 2:] = S  # first half: one document per token; second half: one document
    seg = jnp.asarray(np.tile(ids, (B, 1)))
    strategy, backward = VARIANTS[variant]
    fn = attention_fwd_bwd(cached_mesh(8), strategy, True, (3, 0), backward=backward)
    out, grads = fn(q, k, v, do, seg)
    # A query alone in its document attends only to itself: out == v of its kv head.
    vq = np.repeat(to_np32(v), HQ // 2, axis=2)
    assert_close(to_np32(out)[:, : S // 2], vq[:, : S // 2], 1e-6, "single-token documents")
    check(out, grads, q, k, v, do, seg, causal=True, window=(3, 0))


@pytest.mark.parametrize("G,variant", [(4, "ring_q"), (4, "ring_kv"), (8, "ring_kv"),
                                       (4, "allgather"), (8, "tree")])
def test_rows_with_no_visible_key_block_mask(G, variant):
    """A block-sparse mask whose query block 3 sees no key block: those rows give out = 0,
    and nothing is NaN in the output or the gradients (vs the reference only: jax.nn
    averages such rows instead).  On 4 devices the dead block shares a shard with a live
    one, so its tiles are computed and merged (lse = -inf on both sides of the merge); on
    8 devices it is a whole shard and every tile of it is skipped."""
    b = S // 8  # 8 blocks of 8 tokens; on 8 devices block i is device i's whole shard
    table = np.tril(np.ones((8, 8), bool))
    table[3] = False  # queries 24..31: nothing visible
    table[5] = False
    table[5, 1] = True  # queries 40..47: only keys 8..15 (a far-away device)
    bm = BlockMask(table, b)
    q, k, v = make_qkv(15, B=B, S=S, Hq=HQ, Hkv=2, D=D)
    do = make_cotangent(15, q.shape)
    strategy, backward = VARIANTS[variant]
    fn = attention_fwd_bwd(cached_mesh(G), strategy, True, None, backward=backward,
                           block_mask=bm)
    out, grads = fn(q, k, v, do, None)
    o = to_np32(out)
    chex.assert_tree_all_finite((out, grads))
    assert (o[:, 3 * b:4 * b] == 0).all(), "rows without a visible key must give out = 0"
    assert (to_np32(grads[0])[:, 3 * b:4 * b] == 0).all()
    assert (np.abs(o[:, 4 * b:]).sum(-1) > 0).all()
    ro, rlse, rgrads = reference_fwd_bwd(q, k, v, do, causal=True, block_mask=bm)
    assert np.isneginf(to_np32(rlse)[:, :, 3 * b:4 * b]).all()  # the oracle agrees they are empty
    assert_close(out, ro, 1e-5, "out vs reference")
    for nm, g, rg in zip("qkv", grads, rgrads):
        assert_close(g, rg, 1e-5, f"d{nm} vs reference")


# ----------------------------------------------------------------------------- meshes
@pytest.mark.parametrize("kind,strategy", [
    ("explicit", "ring"), ("explicit", "allgather"), ("auto", "ring"), ("auto", "allgather"),
    ("2d", "ring"), ("2d_both_axes", "ring"), ("2d_both_axes", "allgather"),
    ("explicit", "tree"), ("2d_both_axes", "tree")])
def test_mesh_kinds(kind, strategy):
    devs = jax.devices()
    if kind == "explicit":  # jax.make_mesh: AxisType.Explicit by default in JAX 0.10
        mesh, axis = jax.make_mesh((4,), ("sp",), devices=devs[:4]), "sp"
        if hasattr(jax.sharding, "AxisType"):
            assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    elif kind == "auto":
        mesh, axis = Mesh(np.array(devs[:4]), ("sp",)), "sp"
    elif kind == "2d":  # sequence over "sp" (4 shards), replicated over "dp"
        mesh, axis = jax.make_mesh((2, 4), ("dp", "sp"), devices=devs[:8]), "sp"
    else:  # the sequence split over both axes: 8 shards
        mesh, axis = jax.make_mesh((2, 4), ("dp", "sp"), devices=devs[:8]), ("dp", "sp")
    q, k, v = make_qkv(12, B=B, S=S, Hq=HQ, Hkv=2, D=D)
    do = make_cotangent(12, q.shape)
    fn = attention_fwd_bwd(mesh, strategy, True, None, axis_name=axis)
    out, grads = fn(q, k, v, do, None)
    check(out, grads, q, k, v, do, None, causal=True, window=None)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_eager_grad(kind):
    """``jax.grad`` outside ``jit`` (an explicit-axis mesh needs ``jax.set_mesh`` for the
    eager ``sum``, as any explicitly sharded array does)."""
    devs = jax.devices()[:4]
    mesh = (jax.make_mesh((4,), ("sp",), devices=devs) if kind == "explicit"
            else Mesh(np.array(devs), ("sp",)))
    q, k, v = make_qkv(14, B=B, S=S, Hq=HQ, Hkv=2, D=D)
    c = make_cotangent(14, q.shape)

    def loss(q, k, v):
        return jnp.sum(jsp.attention(q, k, v, mesh=mesh, causal=True) * c)

    if kind == "explicit":
        with jax.set_mesh(mesh):
            grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    else:
        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    _, _, rgrads = reference_fwd_bwd(q, k, v, c, causal=True)
    for nm, g, r in zip("qkv", grads, rgrads):
        assert_close(g, r, 1e-5, f"d{nm}")


class TestJitVariants(chex.TestCase):
    """``attention`` works with and without ``jit`` (and gives the same numbers)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention(self):
        mesh = cached_mesh(2)
        q, k, v = make_qkv(13, B=B, S=S, Hq=HQ, Hkv=1, D=D)
        seg = sorted_segments(13, B, S)
        out = self.variant(lambda q, k, v, seg: jsp.attention(
            q, k, v, mesh=mesh, causal=True, segment_ids=seg))(q, k, v, seg)
        chex.assert_trees_all_equal_shapes_and_dtypes(out, q)
        jit_out, _ = attention_fwd_bwd(mesh, "ring", True, None)(q, k, v, q, seg)
        assert_close(out, jit_out, 1e-6, f"{self.variant.type} vs the jitted fwd+bwd")
        ro, _, _ = reference_fwd_bwd(q, k, v, q, seg, causal=True)
        assert_close(out, ro, 1e-5, f"{self.variant.type} vs reference")


def test_eager_calls_reuse_the_compiled_program(caplog):
    """A second identical eager call must not compile anything."""
    mesh = cached_mesh(2)
    q, k, v = make_qkv(16, B=B, S=S, Hq=HQ, Hkv=2, D=D)
    jsp.attention(q, k, v, mesh=mesh, causal=True)  # warm-up: compiles
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        out = jsp.attention(q, k, v, mesh=mesh, causal=True)
    chex.assert_tree_all_finite(out)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiles, compiles[0][:200]
