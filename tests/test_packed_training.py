"""Packed training is exact (issue 26's acceptance tests).

1. *Packing leaks nothing.*  A batch that ``data.pack_documents`` packed (documents of
   several lengths, per-document positions restarting at 0, segment ids, padding) gives
   the same summed loss and the same parameter gradients as its documents run one by one
   on one device, each alone at its own length from position 0 -- on 1 device and on 8
   with the zigzag and striped layouts, ``backward`` "kv" and "q" (float32, <= 1e-5
   relative).  ``next_token_loss`` returns a *mean* over the weighted targets, so both
   sides compare token-weighted sums: ``loss * metrics["tokens"]``.
2. *Positions are read, and explicit ones are the accurate choice.*  RoPE scores depend
   only on the offset between two tokens, so the same document at position 10^6 is the
   same model in exact arithmetic -- but not in float32, where an angle ``position x
   frequency`` is rounded to 24 bits.  The tests show it at three levels:

   - the rotation (``layers.rope.apply_rope``, head_dim 128 as in Llama): against float64
     the angles at 10^6 are off by up to ~0.03 rad (half an ulp of 10^6) and the q.k
     scores by ~1e-3 relative, where at position 0 they are exact to float32 rounding;
   - the model (single device): a document packed behind another one gets the logits it
     has alone from position 0 when the pack carries its positions (<= 1e-6), and the
     logits it has alone at positions ``offset + arange(n)`` under the global default --
     so a document ``offset`` tokens into a pack *is* that document at those positions,
     and the effect of an offset no CPU test can pack (10^6) is measured on the document
     alone: 9e-4 relative on the logits of this small model;
   - the sequence-parallel model: in every case of (1), the same pack 10^6 tokens further
     on (positions + 10^6, as global positions far into a long pack would give) misses
     the per-document result by far more than the budget, so every layout really rotates
     by the positions it is given (the per-document sums above could not tell a model
     that ignored them, since within a document global positions differ from restarted
     ones only by a shift).

   The model runs its blocks as one scan (``scan_layers=True``: one block compiled per
   program) on the unrolled model's initialisation stacked, so the numbers are the
   unrolled model's (``test_scan_layers.py`` checks the two forms against each other).

   What is *not* shown: a real 10^6-token pack on the sequence-parallel model (too large
   for a CPU test); the equivalence (document at a pack offset == document alone at
   shifted positions) is checked at an offset of a few hundred tokens.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from helpers import assert_close, assert_trees_close, rel_err
from jax_seqpar.data import pack_documents
from jax_seqpar.layers.rope import apply_rope, rope_frequencies
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss
from jax_seqpar.models.stacking import stack_layers

CFG = LlamaConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  scan_layers=True)
B, S = 2, 64
#: Document lengths: 8 documents in 2 rows of 64 with padding; lengths repeat so that the
#: one-by-one reference compiles once per distinct length; the 1-token document has no
#: target and must contribute nothing.
LENGTHS = (30, 13, 7, 24, 13, 7, 24, 1)
TOL = 1e-5
FAR = 10 ** 6


@functools.lru_cache(maxsize=None)
def mesh(G):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def documents():
    rng = np.random.default_rng(26)
    return tuple(rng.integers(1, CFG.vocab_size, n).astype(np.int32) for n in LENGTHS)


@functools.lru_cache(maxsize=None)
def packed_batch():
    batches, report = pack_documents(documents(), S, batch_size=B, policy="best_fit")
    assert len(batches) == 1 and report.rows == B and report.split_documents == 0
    batch = batches[0]
    # the pack is what the test claims: several documents per row, restarting positions,
    # padding at the end of a row
    assert (batch["segment_ids"].max(axis=1) >= 3).all()
    assert (batch["positions"] == 0).sum() > len(LENGTHS)
    assert (batch["segment_ids"] == 0).any()
    return batch


@functools.lru_cache(maxsize=None)
def params():
    unrolled = Llama(dataclasses.replace(CFG, scan_layers=False))
    return jax.jit(lambda k, t: stack_layers(unrolled.init(k, t)))(
        jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def summed_loss(model):
    """``(params, batch) -> (sum of the target NLLs, number of targets)``."""
    def f(p, batch):
        loss, m = next_token_loss(model, p, batch["tokens"], loss_mask=batch.get("loss_mask"),
                                  segment_ids=batch.get("segment_ids"),
                                  positions=batch.get("positions"))
        n = jax.lax.stop_gradient(m["tokens"])
        return loss * n, n
    return f


@functools.lru_cache(maxsize=None)
def summed_loss_and_grad(model):
    return jax.jit(jax.value_and_grad(summed_loss(model), has_aux=True))


@functools.lru_cache(maxsize=None)
def one_by_one():
    """``(summed NLL, gradients, targets)`` over the documents, each run alone on one
    device (no mesh) from position 0 at its own length.  Documents of one length go
    through one compiled function (a ``[1, n]`` call each); a 1-token document has no
    target (nothing to add; the packed side must count none for it either)."""
    f = summed_loss_and_grad(Llama(CFG))
    total, grads, targets = 0.0, None, 0
    for doc in documents():
        if len(doc) == 1:
            continue
        (nll, n), g = f(params(), {"tokens": jnp.asarray(doc)[None]})
        total, targets = total + nll, targets + int(n)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return total, grads, targets


# 4 devices: every document still crosses shard boundaries (zigzag: 8 chunks, striped:
# every token on the next device), at half the compile time of 8 devices' unrolled hops
CASES = [(1, "zigzag", "kv"), (4, "zigzag", "kv"), (4, "zigzag", "q"),
         (4, "striped", "kv"), (4, "striped", "q")]


@pytest.mark.parametrize("G,layout,backward", CASES)
def test_packed_batch_equals_its_documents_one_by_one(G, layout, backward):
    model = Llama(CFG, mesh=mesh(G), layout=layout, backward=backward)
    f = summed_loss_and_grad(model)
    batch = packed_batch()
    (nll, n), grads = f(params(), batch)
    ref_nll, ref_grads, ref_targets = one_by_one()
    what = f"G={G} {layout} backward={backward}"
    assert int(n) == ref_targets == sum(LENGTHS) - len(LENGTHS)
    assert_close(nll, ref_nll, TOL, f"{what}: summed loss")
    assert_trees_close(grads, ref_grads, TOL, f"{what}: dparams")
    # The same pack as if it sat 10^6 tokens into a longer one with global positions: the
    # float32 angle error moves the loss and gradients far beyond the budget (same compiled
    # function; this also proves the layout passes the positions to RoPE).
    (far_nll, _), far_grads = f(params(), dict(batch, positions=batch["positions"] + FAR))
    far_loss = rel_err(far_nll, ref_nll)
    assert far_loss > 2 * TOL, f"{what}: loss far into a pack: {far_loss:.2e}"  # 3.6e-5
    far_err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(far_grads),
                                                 jax.tree.leaves(ref_grads)))
    assert far_err > 100 * TOL, f"{what}: gradients far into a pack: {far_err:.2e}"  # 4.8e-3


def test_rope_angle_error_far_into_a_pack():
    """The float32 rotation at 10^6 against float64: angles off by ~0.03 rad, q.k scores
    by ~1e-3, where per-document positions (the same document at 0) are exact."""
    D, n, theta = 128, 32, 10000.0
    q = jax.random.normal(jax.random.key(1), (1, n, 2, D))
    k = jax.random.normal(jax.random.key(2), (1, n, 2, D))
    inv = np.asarray(rope_frequencies(D, theta), np.float64)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)

    def exact_scores():  # float64 rotation by the offsets alone (what RoPE means)
        ang = np.arange(n)[:, None] * inv
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

        def rot(x):
            x1, x2 = np.split(x, 2, axis=-1)
            return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        return np.einsum("bqhd,bkhd->bhqk", rot(qn), rot(kn))

    def scores(offset):
        pos = jnp.arange(n, dtype=jnp.int32) + offset
        return jnp.einsum("bqhd,bkhd->bhqk", apply_rope(q, pos, theta), apply_rope(k, pos, theta))

    exact = exact_scores()
    at_zero, far = rel_err(scores(0), exact), rel_err(scores(FAR), exact)
    angles32 = (np.arange(n, dtype=np.float32) + np.float32(FAR))[:, None] * inv.astype(
        np.float32)
    angle_err = np.abs(angles32.astype(np.float64) - (np.arange(n) + FAR)[:, None] * inv).max()
    assert at_zero < 1e-6, at_zero
    assert far > 1e-3, far                          # measured 6.5e-3
    assert 0.01 < angle_err <= 2.0 ** -5, angle_err  # half an ulp of 10^6 = 0.03125
    # a document packed at row offset 200 with its own positions rotates exactly as alone
    pack = jnp.concatenate([jax.random.normal(jax.random.key(3), (1, 200, 2, D)), q], 1)
    pos = jnp.concatenate([jnp.arange(200), jnp.arange(n)]).astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(apply_rope(pack, pos, theta)[:, 200:]),
                                  np.asarray(apply_rope(q, jnp.arange(n), theta)))


def test_explicit_positions_keep_a_documents_logits():
    """Model level, one device: a document behind another in a pack.  With the pack's
    per-document positions its logits are those it has alone from 0; with the global
    default they are those it has alone at ``offset + arange(n)``; far into a pack
    (10^6, measured on the document alone) those differ by the angle error."""
    n, offset = 48, 208
    model = Llama(CFG)
    apply = jax.jit(model.apply)
    rng = np.random.default_rng(5)
    doc = rng.integers(1, CFG.vocab_size, n).astype(np.int32)
    (batch,), _ = pack_documents([rng.integers(1, CFG.vocab_size, offset).astype(np.int32),
                                  doc], offset + n, policy="sequential")
    assert (batch["tokens"][0, offset:] == doc).all() and batch["positions"][0, offset] == 0
    alone = lambda shift: apply(params(), doc[None], None,  # noqa: E731
                                (np.arange(n) + shift)[None].astype(np.int32))
    explicit = apply(params(), batch["tokens"], batch["segment_ids"], batch["positions"])
    global_ = apply(params(), batch["tokens"], batch["segment_ids"])
    assert_close(explicit[:, offset:], alone(0), 1e-6, "per-document positions")
    assert_close(global_[:, offset:], alone(offset), 1e-6, "global positions")
    errors = {shift: rel_err(alone(shift), alone(0)) for shift in (4096, 65536, FAR)}
    # measured: 3.6e-6, 5.6e-5, 8.9e-4 (the angle error grows with the position; at the
    # pack's own offset, 208, global and explicit positions agree to 4.5e-7)
    assert errors[4096] < errors[65536] < errors[FAR] and errors[FAR] > 1e-4, errors
