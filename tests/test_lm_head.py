"""The fused LM head + cross-entropy (BurstEngine Alg. 3) against the naive log_softmax
loss: loss, metrics and gradients (dh, dW, dweights), one device and sharded (sequence
over 8 devices in zigzag order; vocabulary over a second mesh axis), the Llama loss fused
vs unfused, and the compiled program's temporary memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from jax_seqpar.layouts import permutation
from jax_seqpar.layers.lm_head import fused_lm_head_loss, reference_lm_head_loss
from jax_seqpar.models import Llama, LlamaConfig, head_weights, next_token_loss

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 1e-5, BF16: 2e-2}
B, S, D, V = 2, 40, 16, 37          # 80 rows: uneven against block_s=24, V against block_v=10
EXTRAS = dict(ignore_index=5, z_loss=1e-2, label_smoothing=0.1, logit_softcap=4.0)


def inputs(seed, dtype=F32, vocab=V, seq=S):
    """Random ``h, w, targets, weights`` (NumPy: no compilation per test shape)."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((B, seq, D), np.float32), dtype)
    w = jnp.asarray(0.6 * rng.standard_normal((D, vocab), np.float32), dtype)
    targets = rng.integers(-4, vocab, (B, seq))                # some negative: ignored
    best = np.argmax(np.einsum("bsd,dv->bsv", np.asarray(h, np.float32),
                               np.asarray(w, np.float32)), axis=-1)
    targets[:, ::3] = best[:, ::3]                             # some right: accuracy > 0
    weights = rng.uniform(0.2, 2.0, (B, seq)).astype(np.float32)
    return h, w, jnp.asarray(targets, jnp.int32), jnp.asarray(weights)


@functools.lru_cache(maxsize=None)
def fused_fn(**kw):
    """jitted ``((loss, metrics), (dh, dw, dweights))`` of ``c * loss`` for a scalar ``c``."""
    def f(h, w, t, wt, c):
        loss, m = fused_lm_head_loss(h, w, t, wt, **kw)
        return c * loss, m
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3), has_aux=True))


@functools.lru_cache(maxsize=None)
def naive_fn(**kw):
    def f(h, w, t, wt, c):
        loss, m = reference_lm_head_loss(h.astype(F32), w.astype(F32), t, wt, **kw)
        return c * loss, m
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3), has_aux=True))


def check(got, ref, tol, what):
    (loss, m), grads = got
    (rloss, rm), rgrads = ref
    assert_close(loss, rloss, tol, f"{what}: loss")
    assert_close(m["accuracy"], rm["accuracy"], 1e-6, f"{what}: accuracy")
    assert_close(m["tokens"], rm["tokens"], 1e-6, f"{what}: tokens")
    if float(rm["z_loss"]):
        assert_close(m["z_loss"], rm["z_loss"], tol, f"{what}: z_loss")
    for name, g, r in zip(("dh", "dw", "dweights"), grads, rgrads):
        assert_close(g, r, tol, f"{what}: {name}")


C = 1.7   # the loss cotangent: the backward must scale the forward's gradients by it


@pytest.mark.parametrize("dtype, blocks", [
    (F32, (None, None)), (F32, (24, 10)), (BF16, (24, 10))],
    ids=["f32-one-tile", "f32-rows+vocab-uneven", "bf16-rows+vocab-uneven"])
def test_matches_naive(dtype, blocks):
    h, w, t, wt = inputs(0, dtype)
    got = fused_fn(block_s=blocks[0], block_v=blocks[1])(h, w, t, wt, C)
    ref = naive_fn()(h, w, t, wt, C)
    check(got, ref, TOL[dtype], f"{jnp.dtype(dtype).name} blocks={blocks}")
    assert got[1][0].dtype == dtype and got[1][1].dtype == dtype   # dh, dW in input dtype


@pytest.mark.parametrize("blocks", [(24, None), (16, 10)], ids=["held", "two-pass"])
def test_extras(blocks):
    """ignore_index, z-loss, label smoothing and the tanh soft cap, all at once."""
    h, w, t, wt = inputs(1)
    t = t.at[:, 1::3].set(EXTRAS["ignore_index"])
    got = fused_fn(block_s=blocks[0], block_v=blocks[1], **EXTRAS)(h, w, t, wt, C)
    ref = naive_fn(**EXTRAS)(h, w, t, wt, C)
    check(got, ref, TOL[F32], f"extras {blocks}")
    plain = naive_fn()(h, w, t, wt, C)
    assert abs(float(got[0][0]) - float(plain[0][0])) > 1e-2   # the extras change the loss


def test_ignored_rows_get_no_gradient_and_bad_targets_give_nan():
    h, w, t, wt = inputs(2)
    t = t.at[0].set(-1)
    (loss, m), (dh, _, dwt) = fused_fn(block_s=24, block_v=None)(h, w, t, wt, C)
    assert float(jnp.abs(dh[0]).max()) == 0 and float(jnp.abs(dwt[0]).max()) == 0
    assert float(jnp.abs(dh[1]).max()) > 0
    assert float(m["tokens"]) == pytest.approx(float(jnp.sum(jnp.where(t >= 0, wt, 0))),
                                               rel=1e-6)
    (loss, _), _ = fused_fn(block_s=24, block_v=None)(h, w, t.at[1, 3].set(V), wt, C)
    assert np.isnan(float(loss))   # traced out-of-range targets poison the loss
    with pytest.raises(ValueError, match="targets hold 37"):  # concrete ones raise
        fused_lm_head_loss(h, w, t.at[1, 3].set(V), wt)


def test_tied_embedding_and_no_weights():
    h, w, t, _ = inputs(3)
    emb = w.T                                            # [V, d], the head is emb.T

    def fused(h, emb):
        return fused_lm_head_loss(h, emb.T, t, block_s=32)[0]

    def naive(h, emb):
        return reference_lm_head_loss(h, emb.T, t)[0]

    got = jax.jit(jax.value_and_grad(fused, (0, 1)))(h, emb)
    ref = jax.jit(jax.value_and_grad(naive, (0, 1)))(h, emb)
    for name, a, b in zip(("loss", "dh", "demb"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert_close(a, b, TOL[F32], name)


def zigzag(x, G):
    return jnp.take(x, jnp.asarray(permutation("zigzag", x.shape[1], G)), axis=1)


def unzigzag(x, G):
    x = np.asarray(jax.device_get(x))
    return np.take(x, np.argsort(permutation("zigzag", x.shape[1], G)), axis=1)


@pytest.mark.parametrize("dtype", [F32], ids=["f32"])
def test_sequence_parallel_zigzag_8_devices(dtype):
    """Rows in zigzag order, sharded over 8 devices: the mean uses the global weight.
    (The held-logits path with uneven row tiles is also test_extras[held].)"""
    G, seq = 8, 48
    mesh = jax.make_mesh((G,), ("sp",))
    h, w, t, wt = inputs(4, dtype, seq=seq)
    wt = wt.at[:, : seq // 2].set(0.0)                   # uneven weight across devices
    (loss, m), (dh, dw, dwt) = fused_fn(mesh=mesh, block_s=5, **EXTRAS)(
        zigzag(h, G), w, zigzag(t, G), zigzag(wt, G), C)
    got = (loss, m), (unzigzag(dh, G), dw, unzigzag(dwt, G))
    check(got, naive_fn(**EXTRAS)(h, w, t, wt, C), TOL[dtype], "sp=8 zigzag")


@pytest.mark.parametrize("block_v", [None, 7], ids=["held", "two-pass"])
def test_vocab_parallel_2d_mesh(block_v):
    """Sequence over 4 devices, vocabulary over 2: dW comes back vocabulary-sharded."""
    mesh = jax.make_mesh((4, 2), ("sp", "vp"))
    h, w, t, wt = inputs(5, vocab=38)
    got = fused_fn(mesh=mesh, vocab_axis="vp", block_s=7, block_v=block_v, **EXTRAS)(
        h, w, t, wt, C)
    check(got, naive_fn(**EXTRAS)(h, w, t, wt, C), TOL[F32], f"4x2 block_v={block_v}")
    assert got[1][1].sharding.spec == jax.sharding.PartitionSpec(None, "vp")
    if block_v:   # the loss-only (evaluation) program, sharded the same way
        loss, _ = jax.jit(lambda h, w: fused_lm_head_loss(
            h, w, t, wt, mesh=mesh, vocab_axis="vp", block_s=7, block_v=block_v, **EXTRAS))(h, w)
        assert_close(loss, got[0][0] / C, TOL[F32], "loss-only")


def test_llama_fused_matches_unfused():
    """``next_token_loss`` fused against the materialised logits, on one device (the
    sequence-parallel model with the fused loss against the same parameters on one device
    is tests/test_llama.py; the fused loss on 8 zigzag devices is
    test_sequence_parallel_zigzag_8_devices; a tied head is test_tied_embedding_*)."""
    cfg = LlamaConfig(vocab_size=61, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      loss_block_s=24, loss_block_v=16)
    toks = jax.random.randint(jax.random.key(6), (2, 32), 0, 61)
    mask = jax.random.bernoulli(jax.random.key(7), 0.7, (2, 32))
    params = jax.jit(Llama(cfg).init)(jax.random.key(0), toks)

    def run(c):
        f = lambda p: next_token_loss(Llama(c), p, toks, loss_mask=mask)  # noqa: E731
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (loss, met), grads = run(cfg)
    (rloss, rmet), rgrads = run(dataclasses.replace(cfg, fused_loss=False))
    assert_close(loss, rloss, TOL[F32], "loss")
    assert float(met["tokens"]) == float(rmet["tokens"])
    assert float(met["accuracy"]) == pytest.approx(float(rmet["accuracy"]), abs=1e-6)
    for (path, g), (_, r) in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                 jax.tree_util.tree_flatten_with_path(rgrads)[0]):
        assert_close(g, r, TOL[F32], jax.tree_util.keystr(path))
    tied = Llama(dataclasses.replace(cfg, tie_embeddings=True))
    np.testing.assert_array_equal(head_weights(tied, params),
                                  params["params"]["embed"]["embedding"].T)


def test_no_logits_sized_buffer():
    """At 8192 rows x 1024 words the logits are 32 MiB of float32, far above everything
    else (h, w, dh, dW: ~1.2 MiB); the fused forward+backward's temporaries must stay an
    order of magnitude below them, the naive one's must exceed them."""
    rows, vocab, d = 8192, 1024, 16
    h = jax.ShapeDtypeStruct((1, rows, d), F32)
    w = jax.ShapeDtypeStruct((d, vocab), F32)
    t = jax.ShapeDtypeStruct((1, rows), jnp.int32)
    logits_bytes = rows * vocab * 4

    def temp(loss_fn):
        g = jax.jit(jax.grad(lambda h, w, t: loss_fn(h, w, t)[0], argnums=(0, 1)))
        return g.lower(h, w, t).compile().memory_analysis().temp_size_in_bytes

    fused = temp(lambda h, w, t: fused_lm_head_loss(h, w, t, block_s=512, block_v=256))
    held = temp(lambda h, w, t: fused_lm_head_loss(h, w, t, block_s=512))
    naive = temp(reference_lm_head_loss)
    assert naive >= logits_bytes, naive
    assert held <= logits_bytes / 8, (held, logits_bytes)
    assert fused <= logits_bytes / 16, (fused, logits_bytes)


@pytest.mark.parametrize("kw, match", [
    (dict(block_s=0), "block_s=0"),
    (dict(block_v=2.5), "block_v=2.5"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(z_loss=-1.0), "z_loss"),
    (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(vocab_axis="vp"), "need a mesh"),
])
def test_errors_name_the_argument(kw, match):
    h, w, t, wt = inputs(8)
    with pytest.raises((ValueError, TypeError), match=match):
        fused_lm_head_loss(h, w, t, wt, **kw)


def test_shape_errors_name_the_argument():
    h, w, t, wt = inputs(9)
    with pytest.raises(ValueError, match=r"w.shape=\(37, 16\)"):
        fused_lm_head_loss(h, w.T, t, wt)
    with pytest.raises(ValueError, match="targets must have shape"):
        fused_lm_head_loss(h, w, t[:, :-1], wt)
    with pytest.raises(TypeError, match="targets.dtype"):
        fused_lm_head_loss(h, w, t.astype(F32), wt)
    with pytest.raises(ValueError, match="weights must have shape"):
        fused_lm_head_loss(h, w, t, wt[0])
    mesh = jax.make_mesh((4, 2), ("sp", "vp"))
    with pytest.raises(ValueError, match="vocab size 37 must be divisible"):
        fused_lm_head_loss(h, w, t, wt, mesh=mesh, vocab_axis="vp")
    with pytest.raises(ValueError, match="'xp' is not an axis"):
        fused_lm_head_loss(h, w, t, wt, mesh=mesh, axis_name="xp")


def test_loss_only_path_skips_the_gradient_matmuls():
    """Not differentiated (evaluation), the loss runs Alg. 3 lines 1-7 only: one logits
    matmul instead of three, same loss and metrics."""
    h, w, t, wt = inputs(10)
    fn = jax.jit(lambda h, w, t, wt: fused_lm_head_loss(h, w, t, wt, block_s=24, **EXTRAS))
    loss, m = fn(h, w, t, wt)
    rloss, rm = reference_lm_head_loss(h, w, t, wt, **EXTRAS)
    assert_close(loss, rloss, TOL[F32], "loss")
    for k in ("accuracy", "tokens", "z_loss"):
        assert_close(m[k], rm[k], TOL[F32], k)

    def dots(f, *args):
        return jax.jit(f).lower(*args).as_text().count("stablehlo.dot_general")

    one_tile = lambda h, w: fused_lm_head_loss(h, w, t, wt)[0]  # noqa: E731
    assert dots(one_tile, h, w) == 1
    assert dots(jax.grad(one_tile, argnums=(0, 1)), h, w) == 3
