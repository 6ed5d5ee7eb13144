"""Attention between one device's queries and another device's keys (a "pair").

The general path calls the local kernel with the full mask and lets it skip tiles whose
position bounds prove them masked.  For a causal mask under the ``contiguous`` and
``zigzag`` layouts the shape of the visible part of a pair of *different* devices is
known in advance, up to which device comes first, so one ``lax.cond`` per pair picks a
mask-free kernel call on exactly the visible part (DistFlashAttn §3.2; BurstEngine
Eq. 12):

* contiguous, query device ``i``, key device ``j != i``: all visible if ``j < i``,
  nothing if ``j > i``.
* zigzag (device ``i`` holds chunks ``i`` and ``2G-1-i``): if ``j < i`` all queries see
  the first key chunk only; if ``j > i`` only the second query chunk sees, and it sees
  both key chunks.  Half the work either way, with static shapes.

* the same device (without segment ids): the halves ``a`` (earlier positions) and ``b``
  of the block give a causal ``a x a``, a mask-free ``b x a`` and a causal ``b x b``;
  ``a x b`` is masked and never visited.  Under the contiguous layout the whole block is
  one aligned tile, and a backend that skips masked key blocks inside the kernel
  (``skips_masked_blocks``: cuDNN, the Pallas kernels) gets it as one call instead: the
  halves would only add their merges, sums, copies and two launches of half the length.

This matters wherever a per-tile ``cond`` is expensive (on GPUs each one waits for its
predicate): the mask-free calls have none.  Segment ids are still applied.

**Packed documents** (issue 27).  With segment ids, a pair of different devices also
skips its compute when its id ranges prove that it shares no document
(``shares_document``: per batch row, the ``[min, max]`` of the query side's ids and of
the key side's are disjoint; zigzag shards are tested as their two chunks).  The test
folds into the ``cond`` the pair has anyway (contiguous: ``kv_dev < q_dev``; zigzag: a
three-way ``switch`` of nothing / earlier / later; general: the position bounds), so it
adds no ``cond``.  It is exact for any ids: a pair is skipped only when no query can see
any key.  Within a pair the kernels skip the tiles that share no document in the same
way (``kernels/pallas_common.tile_lists``), so with segment ids a device's own block is
one kernel call (aligned under contiguous, general under zigzag) rather than its three
causal halves (``_whole_own``).

Every kernel call states its tile kind (``kernels/base.py``): mask-free calls are dense,
the causal halves ``a x a`` and ``b x b`` of the same device are aligned (same
consecutive positions on both sides), and so is the whole same-device block under the
contiguous layout; everything else is general.  So backends that read no positions
(cuDNN) serve every tile of a causal zigzag or contiguous ring.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from jax_seqpar.runtime._compat import vary_like
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel.common import tile_kind
from jax_seqpar.parallel.merge import merge

F32 = jnp.float32
_DENSE = MaskSpec()


def _structured(cfg) -> bool:
    m = cfg.mask
    return (m.causal and m.window is None and m.block_mask is None
            and cfg.layout in ("contiguous", "zigzag"))


def _seg(x, sl):
    return None if x is None else x[:, sl]


def _pair_share(cfg, q_seg, kv_seg):
    """``shares_document`` of two whole shards of the layout: a zigzag shard is two runs
    (when its rows split evenly), any other one run (striped: one run of a strided
    sample, whose range is wide, so striped pairs are rarely skipped)."""
    parts = 2 if (cfg.layout == "zigzag" and q_seg is not None and q_seg.shape[1] % 2 == 0
                  and kv_seg.shape[1] % 2 == 0) else 1
    return shares_document(q_seg, kv_seg, parts, parts)


def _zigzag_share(cfg, q_seg, qs, kv_seg, ks):
    """``shares_document`` of the rows ``qs`` and keys ``ks`` of one device under zigzag
    (its two chunks: chunk ``i`` and ``2G-1-i``); None (no test) under contiguous, where
    the halves are adjacent and nearly always share the document across their border."""
    if cfg.layout != "zigzag":
        return None
    return shares_document(_seg(q_seg, qs), _seg(kv_seg, ks))


def _whole_own(cfg, q_seg, half, rows: int) -> bool:
    """Whether a device's own block runs as one kernel call rather than as its causal
    halves (never under selective checkpointing's halves).  The halves exist to hand
    backends that read no positions (cuDNN) aligned and mask-free tiles, and to spare
    a backend that tests each key block with a ``cond`` (xla) the masked quarter.

    * With segment ids: they need a backend that reads ids and positions (cuDNN and
      flash-attn refuse them), whose tile lists skip the masked quarter and the tiles
      between documents themselves, so one call saves the halves' merges, sums and
      copies.
    * Contiguous layout, a backend that skips masked blocks itself
      (``skips_masked_blocks``): the block is one aligned tile.  On one H100 the halves
      cost cuDNN 15% at 16 rows of 4096 tokens (RESULTS.md, "Packed documents against
      the same documents as a batch").  ``rows``: the block's query rows, which
      choose its backend where ``auto`` orders by row count."""
    if half is not None:
        return False
    return q_seg is not None or (cfg.layout == "contiguous"
                                 and cfg.kernel.skips_masked_blocks_for(rows, cfg.mask))


def _general_aligned(cfg, same: bool) -> bool:
    """Whether a whole same-device block has consecutive positions (contiguous layout)."""
    return same and cfg.layout == "contiguous"


def shares_document(q_seg, kv_seg, q_parts: int = 1, k_parts: int = 1):
    """Whether the query rows ``q_seg`` ``[B, Tq]`` may share a segment id with the keys
    ``kv_seg`` ``[B, Tk]`` (None: no segment ids, so yes).

    False only when, in every batch row, the id ranges ``[min, max]`` of the two sides are
    disjoint, which proves that no query sees any key: true of any ids, sorted or not.
    Each side may be cut into ``*_parts`` equal runs whose ranges are tested pairwise (a
    zigzag shard is two runs far apart, chunks ``i`` and ``2G-1-i``: its range as one
    would span every document in between).  Packed documents keep the ids of a run of
    positions non-decreasing, so a run's range covers just the documents it holds."""
    if q_seg is None:
        return None
    B = q_seg.shape[0]
    qs, ks = q_seg.reshape(B, q_parts, -1), kv_seg.reshape(B, k_parts, -1)
    q_lo, q_hi = qs.min(-1)[:, :, None], qs.max(-1)[:, :, None]
    k_lo, k_hi = ks.min(-1)[:, None, :], ks.max(-1)[:, None, :]
    return jnp.any((q_lo <= k_hi) & (k_lo <= q_hi))


def _and(a, b):
    """Conjunction of traced predicates where None means True."""
    if a is None:
        return b
    return a if b is None else a & b


def _when(pred, compute, nothing):
    """``compute()`` if ``pred`` (None: statically true), else ``nothing()``; one ``cond``."""
    return compute() if pred is None else lax.cond(pred, compute, nothing)


def _general(cfg, q_pos, kv_pos, nothing, compute, share=None, same=False):
    """``compute()`` unless the pair's position bounds prove it masked or its segment id
    ranges prove that it shares no document (``share`` False; then ``nothing()``).  A
    device's own block needs no test (``same``): each of its queries sees at least itself
    under every causal or window mask."""
    pred = None
    if not cfg.mask.is_dense and not (same and cfg.mask.block_mask is None):
        pred = cfg.mask.tile_may_be_visible(q_pos.min(), q_pos.max(), kv_pos.min(),
                                            kv_pos.max())
    return _when(_and(pred, share), compute, nothing)


def _zigzag_other(kv_dev, q_dev, share_earlier, share_later, empty, earlier, later):
    """A zigzag pair of different devices: ``earlier`` if ``kv_dev < q_dev``, else
    ``later``, and ``empty`` where the part that would run shares no document."""
    if share_earlier is None:
        return lax.cond(kv_dev < q_dev, earlier, later)
    branch = jnp.where(kv_dev < q_dev, jnp.where(share_earlier, 1, 0),
                       jnp.where(share_later, 2, 0))
    return lax.switch(branch, [empty, earlier, later])


def pair_fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg, q_dev, kv_dev, *, same: bool,
             half: Optional[int] = None):
    """Float32 ``(o, lse)`` of this pair (``o = 0, lse = -inf`` where nothing is visible).

    ``q_dev`` / ``kv_dev`` are the (traced) devices owning the queries and keys; ``same``
    says statically that they are one device.  ``half`` (0 or 1): ``q``, ``q_pos`` and
    ``q_seg`` are only the first or the second half of the query device's rows
    (sequence-selective checkpointing, ``selective.py``); see ``_half_fwd``.
    """
    B, T, Hq, D = q.shape

    def empty(rows=T):
        return vary_like((jnp.zeros((B, rows, Hq, D), F32),
                          jnp.full((B, Hq, rows), -jnp.inf, F32)), q, k, v)

    def call(qs, ks, vs, qp, kp, qsg, ksg, mask, aligned=False):
        o, lse = cfg.kernel.fwd(qs, ks, vs, qp, kp, mask, cfg.scale, qsg, ksg,
                                tile=tile_kind(mask, aligned))
        return o.astype(F32), lse  # backends may return o in the input dtype

    if not _structured(cfg) or (same and (k.shape[1] % 2 or _whole_own(cfg, q_seg, half, T))):
        aligned = _general_aligned(cfg, same) and half is None
        return _general(cfg, q_pos, kv_pos, empty,
                        lambda: call(q, k, v, q_pos, kv_pos, q_seg, kv_seg, cfg.mask, aligned),
                        None if same else _pair_share(cfg, q_seg, kv_seg), same)
    if half is not None:
        return _half_fwd(cfg, call, empty, q, k, v, q_pos, kv_pos, q_seg, kv_seg, q_dev,
                         kv_dev, same=same, half=half)

    h = T // 2
    first, second = slice(0, h), slice(h, T)
    if same:
        def part(qs, ks, mask):
            return call(q[:, qs], k[:, ks], v[:, ks], q_pos[qs], kv_pos[ks], _seg(q_seg, qs),
                        _seg(kv_seg, ks), mask, aligned=qs == ks)
        o1, lse1 = part(first, first, cfg.mask)
        o2, lse2 = merge(*part(second, first, _DENSE), *part(second, second, cfg.mask))
        return jnp.concatenate([o1, o2], axis=1), jnp.concatenate([lse1, lse2], axis=-1)

    if cfg.layout == "contiguous":
        def full():
            return call(q, k, v, q_pos, kv_pos, q_seg, kv_seg, _DENSE)
        return _when(_and(kv_dev < q_dev, shares_document(q_seg, kv_seg)), full, empty)

    def earlier():  # keys from a lower device: every query sees the first key chunk
        return call(q, k[:, first], v[:, first], q_pos, kv_pos[first], q_seg,
                    _seg(kv_seg, first), _DENSE)

    def later():  # keys from a higher device: the second query chunk sees all of them
        o2, lse2 = call(q[:, second], k, v, q_pos[second], kv_pos, _seg(q_seg, second),
                        kv_seg, _DENSE)
        o0, lse0 = empty()
        return o0.at[:, second].set(o2), lse0.at[..., second].set(lse2)

    return _zigzag_other(kv_dev, q_dev, shares_document(q_seg, _seg(kv_seg, first), 2),
                         shares_document(_seg(q_seg, second), kv_seg, 1, 2), empty, earlier,
                         later)


def _half_fwd(cfg, call, empty, q, k, v, q_pos, kv_pos, q_seg, kv_seg, q_dev, kv_dev, *,
              same: bool, half: int):
    """``pair_fwd`` for one half of the query rows under a structured causal layout.

    The halves of a block hold its earlier and later positions (zigzag: chunks ``i`` and
    ``2G-1-i``), so, with ``a``/``b`` the first/second key half:

    * same device: the first rows see ``a`` causally; the second see ``a`` fully and ``b``
      causally;
    * contiguous, other device: all keys if ``kv_dev < q_dev``, none otherwise;
    * zigzag, other device: if ``kv_dev < q_dev`` both halves see ``a`` only; otherwise
      the first rows see nothing and the second see ``a`` and ``b``.
    """
    h = k.shape[1] // 2
    a, b = slice(0, h), slice(h, None)

    def keys(sl, mask, aligned=False):
        return call(q, k[:, sl], v[:, sl], q_pos, kv_pos[sl], q_seg, _seg(kv_seg, sl), mask,
                    aligned)

    if same:  # the query half against its own key half is a diagonal (aligned) tile
        if half == 0:
            return keys(a, cfg.mask, aligned=True)
        cross = _when(_zigzag_share(cfg, q_seg, slice(None), kv_seg, a),
                      lambda: keys(a, _DENSE), empty)
        return merge(*cross, *keys(b, cfg.mask, aligned=True))
    if cfg.layout == "contiguous":
        return _when(_and(kv_dev < q_dev, shares_document(q_seg, kv_seg)),
                     lambda: keys(slice(None), _DENSE), empty)
    if half == 0:
        return _when(_and(kv_dev < q_dev, shares_document(q_seg, _seg(kv_seg, a))),
                     lambda: keys(a, _DENSE), empty)
    return _zigzag_other(kv_dev, q_dev, shares_document(q_seg, _seg(kv_seg, a)),
                         shares_document(q_seg, kv_seg, 1, 2), empty, lambda: keys(a, _DENSE),
                         lambda: keys(slice(None), _DENSE))


def pair_bwd(cfg, q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, q_dev, kv_dev, *,
             same: bool, o=None):
    """Float32 ``(dq, dk, dv)`` of this pair, with the global ``lse`` and ``delta`` (and
    the global output ``o`` of the query rows, which backends with ``needs_o`` use)."""
    def zeros():
        return vary_like((jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32),
                          jnp.zeros(v.shape, F32)), q, k, v, do, lse)

    def call(qs, ks, vs, ls, dos, ds, qp, kp, qsg, ksg, mask, os=None, aligned=False):
        return cfg.kernel.bwd(qs, ks, vs, os, ls, dos, qp, kp, mask, cfg.scale, qsg, ksg,
                              delta=ds, tile=tile_kind(mask, aligned))

    def rows(sl):
        return None if o is None else o[:, sl]

    T = q.shape[1]
    if not _structured(cfg) or (same and (T % 2 or _whole_own(cfg, q_seg, None, T))):
        return _general(cfg, q_pos, kv_pos, zeros, lambda: call(
            q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, cfg.mask, o,
            _general_aligned(cfg, same)), None if same else _pair_share(cfg, q_seg, kv_seg),
            same)

    h = T // 2
    first, second = slice(0, h), slice(h, T)
    if same:
        def part(qs, ks, mask):
            return call(q[:, qs], k[:, ks], v[:, ks], lse[..., qs], do[:, qs], delta[..., qs],
                        q_pos[qs], kv_pos[ks], _seg(q_seg, qs), _seg(kv_seg, ks), mask,
                        rows(qs), aligned=qs == ks)
        dq1, dk1, dv1 = part(first, first, cfg.mask)
        dq2, dk1b, dv1b = part(second, first, _DENSE)
        dq2b, dk2, dv2 = part(second, second, cfg.mask)
        cat = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
        return cat(dq1, dq2 + dq2b), cat(dk1 + dk1b, dk2), cat(dv1 + dv1b, dv2)

    if cfg.layout == "contiguous":
        def full():
            return call(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, _DENSE, o)
        return _when(_and(kv_dev < q_dev, shares_document(q_seg, kv_seg)), full, zeros)

    def earlier():
        dq, dk1, dv1 = call(q, k[:, first], v[:, first], lse, do, delta, q_pos, kv_pos[first],
                            q_seg, _seg(kv_seg, first), _DENSE, o)
        _, dk, dv = zeros()
        return dq, dk.at[:, first].set(dk1), dv.at[:, first].set(dv1)

    def later():
        dq2, dk, dv = call(q[:, second], k, v, lse[..., second], do[:, second],
                           delta[..., second], q_pos[second], kv_pos, _seg(q_seg, second),
                           kv_seg, _DENSE, rows(second))
        dq, _, _ = zeros()
        return dq.at[:, second].set(dq2), dk, dv

    return _zigzag_other(kv_dev, q_dev, shares_document(q_seg, _seg(kv_seg, first), 2),
                         shares_document(_seg(q_seg, second), kv_seg, 1, 2), zeros, earlier,
                         later)
