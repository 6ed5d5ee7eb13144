"""The fused Hopper backward's key blocks paired within documents
(``MgpuConfig.halves_bwd``, issue 41).

With blocks on multiples of ``2 * block_kv_bwd`` keys, a CTA whose keys hold the end of
one document and the start of the next walks every query step of the later document
with all its keys, the earlier document's masked pair by pair.  Here a CTA's two
consumer blocks of ``bk`` keys (**halves**, on multiples of ``bk``) are paired anew from
each long document's first half, so that the CTA that holds a document's start holds at
most one half of the document before it:

* half ``h`` **starts a region** when it is the first half, or when the id of its last
  key (its owner) starts a run of at least ``anchor // bk`` halves (a document of about
  ``anchor`` keys or more: ``pallas_mgpu_docs.ANCHOR_TOKENS`` by default);
* within a region, halves pair in order; a region of an odd number of halves before
  another region ends in a CTA of one half, whose second consumer runs on a **spare**
  block of ``bk`` keys past the padded keys: K and V zero (read past their end),
  positions as the last key's, and a segment id no query has (``spare_id``), so the
  segment test of the ``"pair"`` class masks every score it has (the last region's last
  half pairs with a padded one, as on multiples);
* a CTA's tiles are classed as in ``tile_lists(classes=True)``, from the ranges of its
  own keys; a one-half CTA's never count as one document, so its masked tiles test
  segments pair by pair and its spare keys stay masked.

Every half lies in exactly one CTA, so each consumer stores its whole block of dK and dV
(the spare's go past the keys, and are dropped): no partial stores, no ownership tests.
If the ids leave no value free at either end of int32 for ``spare_id``, no region starts
past the first half, and the pairing is that of blocks on multiples.

A tile-list row is ``[count, n_full, entries..., first0, first1, c2, c3, c4]``: the
``tile_lists(classes=True)`` layout with each consumer's first key row before the class
starts.  On the bar's documents (64k tokens, around 4k each) this pairing computes
1.0431 pairs per useful pair against 1.0535 for blocks on multiples
(``benchmarks/tile_waste.py``, "halves per document").
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_seqpar.kernels.pallas_common import class_groups, class_order, class_rows
from jax_seqpar.kernels.pallas_mgpu_common import doc_cta_order
from jax_seqpar.kernels.pallas_mgpu_docs import ANCHOR_TOKENS, _next_after
from jax_seqpar.masks import MaskSpec

_I32 = jnp.iinfo(jnp.int32)


def max_ctas(Lk: int, bk: int, anchor: int = ANCHOR_TOKENS) -> int:
    """The static bound on CTAs over ``Lk`` keys (a multiple of ``2 * bk``): one per two
    halves, and one more per region (at most one per ``anchor`` keys, and the first)."""
    return Lk // (2 * bk) + Lk // anchor + 1


def spare_id(q_seg, kv_seg):
    """``(id, ok)``: a segment id that no query or key has (one below the smallest, or one
    above the largest), and whether one was found at either end of int32."""
    lo = jnp.minimum(q_seg.min(), kv_seg.min())
    hi = jnp.maximum(q_seg.max(), kv_seg.max())
    ok = (lo > _I32.min) | (hi < _I32.max)
    return jnp.where(lo > _I32.min, lo - 1, hi + 1).astype(jnp.int32), ok


def pair_halves(kv_seg, Tk: int, bk: int, anchor: int, allow):
    """``(first0, first1, live)`` ``int32 [B, n]`` (``n = max_ctas``): each CTA's first
    key row per consumer, ``first1`` the spare block's row ``Lk`` for a one-half CTA, and
    both for the CTAs left over (which end at once); ``live``: 1 for a CTA that holds
    keys.  ``kv_seg`` ``[B, Lk]`` (padded with the last id); halves past ``Tk`` are left
    out; ``allow`` (a scalar bool): whether regions may start past the first half.

    Half ``h``'s **owner** is the id of its last key; it starts a region when its owner
    differs from half ``h - 1``'s and at least ``anchor // bk`` halves in a row have it
    (a document of about ``anchor`` keys or more), so the regions are at most ``Lk //
    anchor + 1``.  Worked on ``[B, Lk // bk]`` arrays, a few small XLA kernels."""
    B, Lk = kv_seg.shape
    nh = Lk // bk
    n = max_ctas(Lk, bk, anchor)
    owner = jnp.asarray(kv_seg, jnp.int32).reshape(B, nh, bk)[..., -1]
    h = jnp.arange(nh, dtype=jnp.int32)
    hb = jnp.broadcast_to(h[None, :], (B, nh))
    change = jnp.concatenate([jnp.zeros((B, 1), bool), owner[:, 1:] != owner[:, :-1]], 1)
    long = _next_after(change, hb, nh) - hb >= max(1, anchor // bk)
    starts = (change & long & allow) | (hb == 0)
    used = hb * bk < Tk
    region = lax.cummax(jnp.where(starts, hb, 0), axis=1)             # its first half
    # past its last half; the last region runs on over the padded halves, so that its
    # last real half pairs with one of them (as on multiples) rather than with the spare
    region_end = _next_after(starts, hb, nh)
    lead = used & ((hb - region) % 2 == 0)                             # a CTA's first half
    two = lead & (hb + 1 < region_end)
    rank = jnp.cumsum(lead, axis=1, dtype=jnp.int32) - 1
    dest = jnp.where(lead, rank, n + hb)  # out of bounds (dropped), distinct
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, nh))
    vals = jnp.stack([hb * bk, jnp.where(two, (hb + 1) * bk, Lk)], -1)  # [B, nh, 2]
    firsts = jnp.full((B, n, 2), Lk, jnp.int32).at[rows, dest].set(
        vals, mode="drop", unique_indices=True)
    return firsts[..., 0], firsts[..., 1], (firsts[..., 0] < Lk).astype(jnp.int32)


def _key_ranges(x, first0, first1, live, bk: int):
    """Per CTA, ``(min, max)`` of ``x`` ``[B, Lk + bk]`` over its real halves (the spare
    block left out), from each half's range."""
    B, L = x.shape
    xh = x.reshape(B, L // bk, bk)
    lo_h, hi_h = xh.min(-1), xh.max(-1)           # [B, nh + 1]: the spare's last
    a0, a1 = (jnp.take_along_axis(v, first0 // bk, 1) for v in (lo_h, hi_h))
    b0, b1 = (jnp.take_along_axis(v, first1 // bk, 1) for v in (lo_h, hi_h))
    spare = first1 >= L - bk
    lo = jnp.where(spare, a0, jnp.minimum(a0, b0))
    hi = jnp.where(spare, a1, jnp.maximum(a1, b1))
    return jnp.where(live > 0, lo, _I32.max), jnp.where(live > 0, hi, _I32.min)


def halves_tile_lists(mask: MaskSpec, q_pos, kv_pos, q_seg, kv_seg, Tk: int, bq: int,
                      bk: int, anchor: int = ANCHOR_TOKENS, allow=None):
    """``(tbl, order)`` for the fused backward with halves paired within documents: per
    CTA its query steps (blocks of ``bq`` rows on multiples of ``bq``) sorted by
    ``MASK_CLASSES``, and a launch order by document (``doc_cta_order(last=True)``).
    ``q_pos``, ``q_seg`` ``[B, Lq]``; ``kv_pos`` ``[Lk + bk]``, ``kv_seg`` ``[B, Lk +
    bk]``: the keys padded to a multiple of ``2 * bk``, then the spare block
    (``pad_spare``).  ``anchor``: ``ANCHOR_TOKENS`` (smaller in tests); ``allow``:
    ``spare_id``'s second value, if the caller has it."""
    B, Lq = q_seg.shape
    Lk = kv_seg.shape[1] - bk
    kv_seg = jnp.asarray(kv_seg, jnp.int32)
    if allow is None:
        allow = spare_id(q_seg, kv_seg[:, :Lk])[1]
    f0, f1, live = pair_halves(kv_seg[:, :Lk], Tk, bk, anchor, allow)
    kv_pos = jnp.broadcast_to(jnp.asarray(kv_pos, jnp.int32), kv_seg.shape)
    kp = _key_ranges(kv_pos, f0, f1, live, bk)
    kg = _key_ranges(kv_seg, f0, f1, live, bk)
    qb = jnp.asarray(q_pos, jnp.int32).reshape(B, Lq // bq, bq)
    sb = jnp.asarray(q_seg, jnp.int32).reshape(B, Lq // bq, bq)
    qp, qg = (qb.min(-1), qb.max(-1)), (sb.min(-1), sb.max(-1))
    K = lambda x: x[:, :, None]  # noqa: E731  rows: CTAs, columns: query steps
    Q = lambda x: x[:, None, :]  # noqa: E731
    pos_vis = mask.tile_may_be_visible(Q(qp[0]), Q(qp[1]), K(kp[0]), K(kp[1]))
    pos_all = mask.tile_fully_visible(Q(qp[0]), Q(qp[1]), K(kp[0]), K(kp[1]))
    shape = (B, f0.shape[1], qb.shape[1])
    share = (Q(qg[0]) <= K(kg[1])) & (K(kg[0]) <= Q(qg[1]))
    vis = jnp.broadcast_to(pos_vis, shape) & share & K(live > 0)
    # whole: two real halves, every key below Tk
    k_whole = (f1 < Lk) & (f1 + bk <= Tk)
    k_one = k_whole & (kg[0] == kg[1])
    pos_full = jnp.broadcast_to(pos_all, shape) & K(k_whole)
    full = pos_full & K(k_one) & Q(qg[0] == qg[1]) & (K(kg[0]) == Q(qg[0])) & vis
    order, ends = class_order(vis, class_groups(full, K(k_one), pos_full))
    launch = doc_cta_order(class_rows(ends, order), last=True, classes=True)
    tbl = class_rows(ends, jnp.concatenate([order, K(f0), K(f1)], -1))
    return tbl.astype(jnp.int32), launch


def pad_spare(kv_pos, kv_seg, spare, bk: int):
    """Positions ``[Lk]`` and ids ``[B, Lk]`` with the spare block of ``bk`` keys after
    them: the last key's position, ``spare``.  (K and V are not copied: the spare block's
    rows lie past their end, where the kernel's TMA loads read zeros.)"""
    B = kv_seg.shape[0]
    return (jnp.concatenate([kv_pos, jnp.broadcast_to(kv_pos[-1:], (bk,))]),
            jnp.concatenate([kv_seg, jnp.broadcast_to(spare, (B, bk)).astype(jnp.int32)], 1))
