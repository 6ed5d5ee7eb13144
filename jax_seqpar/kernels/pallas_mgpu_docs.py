"""Blocks laid from each document's first token, for the fused Hopper backward
(``MgpuConfig.doc_blocks_bwd``, issue 41).

The tile lists of ``pallas_common.tile_lists`` put blocks on multiples of the block
size, so on packed documents a block that holds the end of one document and the start
of the next walks both documents' tiles with a segment test per pair, and each
document's diagonal runs through tiles it shares with its neighbour.  Here the fused
backward's key blocks (``2 * block_kv_bwd`` keys a CTA) and its query steps
(``block_q_bwd``) start over at each long document's first token:

* a **region** starts at row 0 and at the first token of every run of equal segment ids
  at least ``ANCHOR_TOKENS`` long (shorter documents join the region before them, whose
  blocks then hold several documents and take the segment test per pair, as now);
* within a region, blocks lie on multiples of their size from its start rounded down to
  ``ALIGN`` rows (Mosaic GPU's TMA copies into swizzled blocks start on multiples of 8),
  and each block **owns** the rows from its start, or the region's, to the next block's
  start or the region's end.  The rows it loads but does not own belong to another
  block: a key CTA stores only the rows of dK and dV it owns, and its other keys are
  masked in the tiles that test segments per pair; a query step's other rows get
  ``P = 0`` (their lse folded to ``+inf``), so their dQ gets zeros added;
* the grid has one CTA per key block, at most ``L / size + L // ANCHOR_TOKENS + 1``
  (each region adds at most one partial block), the unused ones empty.

A tile-list row is ``[count, n_full, entries..., first, lo << 8 | hi, c2, c3, c4]``: the
``pallas_common.tile_lists(classes=True)`` layout with the key block's rows (``doc_blocks``)
before the class starts, and each entry a query step (``pack_entry``).  On the bar's
documents (64k tokens, around 4k each) the lists hold 1.0364 computed pairs per useful
pair instead of 1.0535 (``benchmarks/tile_waste.py``); the kernel ran 3.5% slower on
one H200 all the same (RESULTS.md, "The fused backward's blocks laid per document").
Tried and taken out (48154d4): the tests of owned rows and keys in a fifth mask class of
their own, so that the other four carry no code for them; ptxas then spilled 376 bytes a
thread instead of 284, and the kernel ran 4.7% slower than the default's lists.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_seqpar.kernels.pallas_common import class_groups, class_order, class_rows
from jax_seqpar.kernels.pallas_mgpu_common import doc_cta_order
from jax_seqpar.masks import MaskSpec

#: A run of equal segment ids at least this long starts a region of its own (the
#: default of ``MgpuConfig.doc_anchor_bwd``).  It bounds the extra CTAs (one per region)
#: to ``L // ANCHOR_TOKENS + 1``.
ANCHOR_TOKENS = 1024
#: A block's loads start on a multiple of this many rows: Mosaic GPU tiles a swizzled
#: shared-memory block by 8 rows and gives a TMA copy's global index the same tiling.
ALIGN = 8
_BIG = jnp.iinfo(jnp.int32).max


def max_blocks(L: int, size: int, anchor: int = ANCHOR_TOKENS) -> int:
    """The static bound on blocks of ``size`` over ``L`` rows (see the module doc)."""
    return -(-L // size) + L // anchor + 1


def _next_after(flag, idx, T: int):
    """For each row, the first row after it where ``flag`` holds (``T`` if none)."""
    at = jnp.where(flag, idx, T)
    B = flag.shape[0]
    return lax.cummin(jnp.concatenate([at[:, 1:], jnp.full((B, 1), T, jnp.int32)], 1),
                      axis=1, reverse=True)


def doc_blocks(seg, T: int, size: int, anchor: int = ANCHOR_TOKENS):
    """``(first, lo, hi)`` ``int32 [B, n]`` (``n = max_blocks(L, size)``) of the blocks of
    ``size`` rows over the first ``T`` of ``seg``'s ``[B, L]`` rows: each block loads rows
    ``first .. first + size`` (``first`` a multiple of ``ALIGN``) and owns rows
    ``first + lo .. first + hi``.  A region opening at row ``s`` lays its blocks from
    ``s`` rounded down to ``ALIGN``; its first block owns from ``s`` on, the rows before
    belonging to the region before.  Unused blocks own nothing (``lo = hi = 0``)."""
    B, L = seg.shape
    seg = jnp.asarray(seg, jnp.int32)
    idx = jnp.arange(L, dtype=jnp.int32)[None, :]
    real = idx < T
    new_run = jnp.concatenate(
        [jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1) & real
    run_end = jnp.minimum(_next_after(new_run, idx, T), T)
    opens = new_run & ((run_end - idx >= anchor) | (idx == 0))
    region = lax.cummax(jnp.where(opens, idx, 0), axis=1)    # each row's region start
    origin = region - region % ALIGN                            # where its blocks are laid
    owns_first = real & ((idx == region) | ((idx - origin) % size == 0))
    n = max_blocks(L, size, anchor)
    rank = jnp.cumsum(owns_first, axis=1, dtype=jnp.int32) - 1
    dest = jnp.where(owns_first, rank, n + idx)  # out of bounds (dropped), distinct
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, L))
    own = jnp.full((B, n), T, jnp.int32).at[rows, dest].set(
        jnp.broadcast_to(idx, (B, L)), mode="drop", unique_indices=True)
    at = jnp.clip(own, 0, L - 1)
    o = jnp.take_along_axis(origin, at, axis=1)
    first = o + (own - o) // size * size
    end = jnp.minimum(first + size, jnp.take_along_axis(_next_after(opens, idx, T), at, 1))
    used = own < T
    return (jnp.where(used, first, 0), jnp.where(used, own - first, 0),
            jnp.where(used, end - first, 0))


def live_ranges(x, first, lo, hi, size: int):
    """Per block, ``(min, max)`` of ``x`` ``[B, L]`` over the rows it owns (``(BIG,
    -BIG)`` for a block that owns none)."""
    B, L = x.shape
    off = jnp.arange(size, dtype=jnp.int32)
    rows = jnp.clip(first[..., None] + off, 0, L - 1)
    vals = jnp.take_along_axis(x, rows.reshape(B, -1), axis=1).reshape(rows.shape)
    ok = (off >= lo[..., None]) & (off < hi[..., None])
    return jnp.where(ok, vals, _BIG).min(-1), jnp.where(ok, vals, -_BIG).max(-1)


def doc_tile_lists(mask: MaskSpec, q_pos, kv_pos, q_seg, kv_seg, Tq: int, Tk: int,
                   bq: int, bkc: int, anchor: int = ANCHOR_TOKENS):
    """``(tbl, order)`` for the fused backward: per key block (``bkc`` keys) its query
    steps (``bq`` rows), as the module doc lays them out, sorted by ``MASK_CLASSES``,
    and a launch order of key blocks by document (``doc_cta_order(last=True)``).
    ``q_pos``, ``q_seg`` ``[B, Lq]``, ``kv_pos`` ``[Lk]``, ``kv_seg`` ``[B, Lk]``
    (padded to at least ``Tq`` / ``Tk``).

    A tile is listed when its live rows may share a document and positions may let a
    pair through; it is fully visible when both blocks are whole (every row live), hold
    one and the same document and positions prove every pair visible.  Its class is
    ``"fold"`` when the key block is whole and one document, so the kernel's only
    segment test is the query's (folded into its lse); else ``"pair"``, which also
    tests each key's row against the block's live end.  ``anchor``: ``ANCHOR_TOKENS``
    (smaller in tests)."""
    B = q_seg.shape[0]
    kv_pos = jnp.broadcast_to(jnp.asarray(kv_pos, jnp.int32), (B, kv_seg.shape[1]))
    q_pos = jnp.asarray(q_pos, jnp.int32)
    kb = doc_blocks(kv_seg, Tk, bkc, anchor)
    qb = doc_blocks(q_seg, Tq, bq, anchor)
    kp = live_ranges(kv_pos, *kb, bkc)
    kg = live_ranges(jnp.asarray(kv_seg, jnp.int32), *kb, bkc)
    qp = live_ranges(q_pos, *qb, bq)
    qg = live_ranges(jnp.asarray(q_seg, jnp.int32), *qb, bq)
    # [B, n_k, n_q]: rows are key blocks, columns query steps
    K = lambda x: x[:, :, None]  # noqa: E731
    Q = lambda x: x[:, None, :]  # noqa: E731
    pos_vis = mask.tile_may_be_visible(Q(qp[0]), Q(qp[1]), K(kp[0]), K(kp[1]))
    pos_all = mask.tile_fully_visible(Q(qp[0]), Q(qp[1]), K(kp[0]), K(kp[1]))
    shape = (B, kb[0].shape[1], qb[0].shape[1])
    share = (Q(qg[0]) <= K(kg[1])) & (K(kg[0]) <= Q(qg[1]))
    vis = (jnp.broadcast_to(pos_vis, shape) & share & K(kb[2] > kb[1])
           & Q(qb[2] > qb[1]))
    k_whole = (kb[1] == 0) & (kb[2] == bkc)  # (owned rows are below Tk)
    k_one = k_whole & (kg[0] == kg[1])
    q_one = (qb[1] == 0) & (qb[2] == bq) & (qg[0] == qg[1])
    pos_full = jnp.broadcast_to(pos_all, shape) & K(k_whole)
    full = pos_full & K(k_one) & Q(q_one) & (K(kg[0]) == Q(qg[0])) & vis
    order, ends = class_order(vis, class_groups(full, K(k_one), pos_full))
    launch = doc_cta_order(class_rows(ends, order), last=True, classes=True)
    flat = order.reshape(B, -1)
    step = pack_entry(*(jnp.take_along_axis(x, flat, 1) for x in qb)).reshape(order.shape)
    tbl = class_rows(ends, jnp.concatenate([step, K(kb[0]), K(kb[1] << 8 | kb[2])], -1))
    return tbl.astype(jnp.int32), launch


def pack_entry(first, lo, hi):
    """A query step's entry: ``first / ALIGN << 11 | lo << 8 | hi`` (``lo < ALIGN``,
    ``hi <= 255``)."""
    return (first // ALIGN) << 11 | lo << 8 | hi


def entry_rows(entry):
    """``(first, lo, hi)`` of a query step's entry (in a kernel or outside)."""
    first = lax.shift_left(lax.shift_right_logical(entry, jnp.int32(11)), jnp.int32(3))
    return first, lax.shift_right_logical(entry, jnp.int32(8)) & 7, entry & 255


def cta_fields(tbl_row_first, tbl_row_range):
    """``(first, lo, hi)`` of a key block from its row's two fields."""
    return tbl_row_first, lax.shift_right_logical(tbl_row_range, jnp.int32(8)), \
        tbl_row_range & 255
