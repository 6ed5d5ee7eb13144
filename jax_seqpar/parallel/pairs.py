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

* the same device (both layouts): the halves ``a`` (earlier positions) and ``b`` of the
  block give a causal ``a x a``, a mask-free ``b x a`` and a causal ``b x b``; ``a x b``
  is masked and never visited.

This matters wherever a per-tile ``cond`` is expensive (on GPUs each one waits for its
predicate): the mask-free calls have none.  Segment ids are still applied.

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

from jax_seqpar._compat import vary_like
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, TILE_GENERAL
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel.merge import merge

F32 = jnp.float32
_DENSE = MaskSpec()


def _structured(cfg) -> bool:
    m = cfg.mask
    return (m.causal and m.window is None and m.block_mask is None
            and cfg.layout in ("contiguous", "zigzag"))


def _seg(x, sl):
    return None if x is None else x[:, sl]


def _tile(mask: MaskSpec, aligned: bool) -> str:
    """The tile kind of a call with ``mask``; ``aligned``: same consecutive positions."""
    if mask.is_dense:
        return TILE_DENSE
    return TILE_ALIGNED if aligned and mask.block_mask is None else TILE_GENERAL


def _general_aligned(cfg, same: bool) -> bool:
    """Whether a whole same-device block has consecutive positions (contiguous layout)."""
    return same and cfg.layout == "contiguous"


def _general(cfg, q_pos, kv_pos, nothing, compute):
    """``compute()`` unless the pair's position bounds prove it masked (then ``nothing()``)."""
    if cfg.mask.is_dense:
        return compute()
    pred = cfg.mask.tile_may_be_visible(q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max())
    return lax.cond(pred, compute, nothing)


def pair_fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg, q_dev, kv_dev, *, same: bool,
             half: Optional[int] = None):
    """Float32 ``(o, lse)`` of this pair (``o = 0, lse = -inf`` where nothing is visible).

    ``q_dev`` / ``kv_dev`` are the (traced) devices owning the queries and keys; ``same``
    says statically that they are one device.  ``half`` (0 or 1): ``q``, ``q_pos`` and
    ``q_seg`` are only the first or the second half of the query device's rows
    (sequence-selective checkpointing, ``selective.py``); see ``_half_fwd``.
    """
    B, T, Hq, D = q.shape

    def empty():
        return vary_like((jnp.zeros((B, T, Hq, D), F32), jnp.full((B, Hq, T), -jnp.inf, F32)),
                         q, k, v)

    def call(qs, ks, vs, qp, kp, qsg, ksg, mask, aligned=False):
        o, lse = cfg.kernel.fwd(qs, ks, vs, qp, kp, mask, cfg.scale, qsg, ksg,
                                tile=_tile(mask, aligned))
        return o.astype(F32), lse  # backends may return o in the input dtype

    if not _structured(cfg) or (same and k.shape[1] % 2):
        aligned = _general_aligned(cfg, same) and half is None
        return _general(cfg, q_pos, kv_pos, empty,
                        lambda: call(q, k, v, q_pos, kv_pos, q_seg, kv_seg, cfg.mask, aligned))
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
        return lax.cond(kv_dev < q_dev, full, empty)

    def earlier():  # keys from a lower device: every query sees the first key chunk
        return call(q, k[:, first], v[:, first], q_pos, kv_pos[first], q_seg,
                    _seg(kv_seg, first), _DENSE)

    def later():  # keys from a higher device: the second query chunk sees all of them
        o2, lse2 = call(q[:, second], k, v, q_pos[second], kv_pos, _seg(q_seg, second),
                        kv_seg, _DENSE)
        o0, lse0 = empty()
        return o0.at[:, second].set(o2), lse0.at[..., second].set(lse2)

    return lax.cond(kv_dev < q_dev, earlier, later)


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
        return merge(*keys(a, _DENSE), *keys(b, cfg.mask, aligned=True))
    if cfg.layout == "contiguous":
        return lax.cond(kv_dev < q_dev, lambda: keys(slice(None), _DENSE), empty)
    later = empty if half == 0 else (lambda: keys(slice(None), _DENSE))
    return lax.cond(kv_dev < q_dev, lambda: keys(a, _DENSE), later)


def pair_bwd(cfg, q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, q_dev, kv_dev, *,
             same: bool, o=None):
    """Float32 ``(dq, dk, dv)`` of this pair, with the global ``lse`` and ``delta`` (and
    the global output ``o`` of the query rows, which backends with ``needs_o`` use)."""
    def zeros():
        return vary_like((jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32),
                          jnp.zeros(v.shape, F32)), q, k, v, do, lse)

    def call(qs, ks, vs, ls, dos, ds, qp, kp, qsg, ksg, mask, os=None, aligned=False):
        return cfg.kernel.bwd(qs, ks, vs, os, ls, dos, qp, kp, mask, cfg.scale, qsg, ksg,
                              delta=ds, tile=_tile(mask, aligned))

    def rows(sl):
        return None if o is None else o[:, sl]

    T = q.shape[1]
    if not _structured(cfg) or (same and T % 2):
        return _general(cfg, q_pos, kv_pos, zeros, lambda: call(
            q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, cfg.mask, o,
            _general_aligned(cfg, same)))

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
        return lax.cond(kv_dev < q_dev, full, zeros)

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

    return lax.cond(kv_dev < q_dev, earlier, later)
