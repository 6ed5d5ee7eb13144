"""Ring attention, per device (call inside ``shard_map``).

Forward (Ring Attention; BurstAttention Alg. 1): each device keeps its query block and
passes its key/value block around the ring with ``ppermute``; at step ``s`` device ``i``
holds the block of device ``(i - s) mod G``, computes the local tile with the kernel while
the block travels on, and merges ``(o, lse)`` online (``merge.py``).  ``G - 1`` transfers
of K and V per device; a step whose position bounds prove it fully masked skips its
compute (the transfer still happens, since the block must keep moving).

Backward (``custom_vjp``):

* ``backward="kv"`` (Ring Attention): K, V travel as in the forward, together with
  float32 accumulators dK, dV that collect every device's contribution and take one last
  hop home, cast to the gradient dtype first.  This ring turns the opposite way to the forward's (see ``_backward_kv``).  Per device: ``(G - 1)`` transfers of K, V and ``G`` of dK, dV.
* ``backward="q"`` (BurstAttention Alg. 2): each device keeps K, V, dK, dV; the ring
  carries Q, dO, D = rowsum(dO * O), lse and a float32 dQ accumulator, which takes one
  last hop home in the gradient dtype.  ``G - 1`` transfers of Q, dO, D, lse and ``G`` of dQ.
* ``backward="auto"``: the scheme that sends fewer bytes (``costs.choose_backward``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jax_seqpar._compat import vary_like
from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.layouts import shard_positions
from jax_seqpar.masks import WindowArg
from jax_seqpar.parallel.common import AttnConfig, axis_size, make_config, ring_shift
from jax_seqpar.parallel.costs import RingShape, choose_backward
from jax_seqpar.parallel.merge import merge

F32 = jnp.float32


def ring_attention(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B T Hkv D"],
    v: Float[Array, "B T Hkv D"],
    segment_ids: Optional[Int[Array, "B T"]] = None,
    *,
    axis_name="sp",
    causal: bool = False,
    window: WindowArg = None,
    scale: Optional[float] = None,
    layout: str = "contiguous",
    backward: str = "kv",
    kernel="auto",
) -> Float[Array, "B T Hq D"]:
    """Per-device ring self-attention over the sequence axis ``axis_name``.

    ``q``, ``k``, ``v`` and ``segment_ids`` are this device's shards, in ``layout`` order.
    Returns this device's shard of the output, in the dtype of ``q``.
    """
    cfg = make_config(q, k, axis_name=axis_name, causal=causal, window=window,
                      segment_ids=segment_ids, scale=scale, layout=layout,
                      backward=backward, kernel=kernel)
    return ring_attention_with_config(cfg, q, k, v, segment_ids)


def ring_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    if cfg.backward == "auto":
        choice = choose_backward(ring_shape(q, k, segment_ids, axis_size(cfg.axis_name)))
        cfg = dataclasses.replace(cfg, backward=choice.scheme)
    return _ring(cfg, q, k, v, segment_ids)


def ring_shape(q, k, segment_ids, num_devices: int) -> RingShape:
    """The per-device shapes that fix ring traffic (for ``costs``)."""
    B, T, Hq, D = q.shape
    return RingShape(num_devices=num_devices, batch=B, tokens=T, q_heads=Hq,
                     kv_heads=k.shape[2], head_dim=D, itemsize=jnp.dtype(q.dtype).itemsize,
                     has_segments=segment_ids is not None)


def _positions(cfg: AttnConfig, shard, T: int, G: int):
    return shard_positions(cfg.layout, shard, T, G)


def _visible(cfg: AttnConfig, q_pos, kv_pos):
    return cfg.mask.tile_may_be_visible(q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max())


def _cond(cfg: AttnConfig, pred, fn, skip, *args):
    if cfg.mask.is_dense:
        return fn(*args)
    return lax.cond(pred, fn, skip, *args)


def _ring_forward(cfg: AttnConfig, q, k, v, seg):
    """Returns float32 ``o`` ``[B, T, Hq, D]`` and ``lse`` ``[B, Hq, T]``."""
    B, T, Hq, D = q.shape
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    q_pos = _positions(cfg, idx, T, G)
    o = jnp.zeros((B, T, Hq, D), F32)
    lse = jnp.full((B, Hq, T), -jnp.inf, F32)
    o, lse = vary_like((o, lse), q, k, v)
    block = (k, v, seg)
    for step in range(G):
        nxt = ring_shift(block, cfg.axis_name, G) if step < G - 1 else None
        kc, vc, sc = block
        kv_pos = _positions(cfg, (idx - step) % G, T, G)

        def compute(o, lse, kc=kc, vc=vc, sc=sc, kv_pos=kv_pos):
            o_s, lse_s = cfg.kernel.fwd(q, kc, vc, q_pos, kv_pos, cfg.mask, cfg.scale, seg, sc)
            return merge(o, lse, o_s, lse_s)

        o, lse = _cond(cfg, _visible(cfg, q_pos, kv_pos), compute, lambda o, lse: (o, lse), o, lse)
        block = nxt
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: AttnConfig, q, k, v, seg):
    o, _ = _ring_forward(cfg, q, k, v, seg)
    return o.astype(q.dtype)


def _ring_fwd(cfg, q, k, v, seg):
    o, lse = _ring_forward(cfg, q, k, v, seg)
    o = o.astype(q.dtype)
    return o, (q, k, v, seg, o, lse)


def _ring_bwd(cfg, res, do):
    q, k, v, seg, o, lse = res
    bwd = {"kv": _backward_kv, "q": _backward_q}[cfg.backward]
    dq, dk, dv = bwd(cfg, q, k, v, seg, o, lse, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _backward_kv(cfg: AttnConfig, q, k, v, seg, o, lse, do):
    """Ring Attention backward: K, V, dK, dV circulate; Q, dO, lse, delta stay home.

    The backward ring turns the other way (device i sends to i - 1).  Were it to turn the
    same way as the forward, XLA would CSE its K/V transfers with the forward's and keep
    all G rotated blocks alive between the two passes: O(S) memory per device instead of
    O(S / G).  An ``optimization_barrier`` does not survive XLA's passes on CPU, so the
    direction is what keeps the two rings distinct.
    """
    B, T, Hq, D = q.shape
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    q_pos = _positions(cfg, idx, T, G)
    delta = attention_delta(o, do)  # once, not per step (BurstAttention Alg. 2 line 2)
    dq = vary_like(jnp.zeros(q.shape, F32), q, k, v, do)
    block = (k, v, seg)
    acc = vary_like((jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)), q, k, v, do)
    for step in range(G):
        nxt = ring_shift(block, cfg.axis_name, G, reverse=True) if step < G - 1 else None
        kc, vc, sc = block
        kv_pos = _positions(cfg, (idx + step) % G, T, G)

        def compute(dq, dkc, dvc, kc=kc, vc=vc, sc=sc, kv_pos=kv_pos):
            dq_s, dk_s, dv_s = cfg.kernel.bwd(q, kc, vc, o, lse, do, q_pos, kv_pos, cfg.mask,
                                              cfg.scale, seg, sc, delta=delta)
            return dq + dq_s, dkc + dk_s, dvc + dv_s

        dq, dkc, dvc = _cond(cfg, _visible(cfg, q_pos, kv_pos), compute,
                             lambda *a: a, dq, *acc)
        if step == G - 1:  # complete: the hop home carries them in the gradient dtype
            dkc, dvc = dkc.astype(k.dtype), dvc.astype(v.dtype)
        # The accumulators move every step; after the last one they are back home.
        acc = ring_shift((dkc, dvc), cfg.axis_name, G, reverse=True) if G > 1 else (dkc, dvc)
        block = nxt
    return dq, acc[0], acc[1]


def _backward_q(cfg: AttnConfig, q, k, v, seg, o, lse, do):
    """BurstAttention backward (Alg. 2): Q, dO, D, lse and dQ circulate; K, V stay home.

    Line 2: ``D = rowsum(dO * O)`` once.  Lines 4-16: at step ``s`` device ``i`` holds the
    query block of device ``(i - s) mod G`` with its running dQ, adds its K/V block's
    contribution to dQ (line 14) and to its own dK, dV (lines 10, 13), and passes the
    block on.  After the last step the dQ accumulators take one more hop to their owners.
    """
    B, T, Hq, D = q.shape
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    kv_pos = _positions(cfg, idx, T, G)
    delta = attention_delta(o, do)
    dk, dv = vary_like((jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)), q, k, v, do)
    dqc = vary_like(jnp.zeros(q.shape, F32), q, k, v, do)
    block = (q, do, delta, lse, seg)
    for step in range(G):
        nxt = ring_shift(block, cfg.axis_name, G) if step < G - 1 else None
        qc, doc, dc, lc, sc = block
        q_pos = _positions(cfg, (idx - step) % G, T, G)

        def compute(dqc, dk, dv, qc=qc, doc=doc, dc=dc, lc=lc, sc=sc, q_pos=q_pos):
            dq_s, dk_s, dv_s = cfg.kernel.bwd(qc, k, v, None, lc, doc, q_pos, kv_pos, cfg.mask,
                                              cfg.scale, sc, seg, delta=dc)
            return dqc + dq_s, dk + dk_s, dv + dv_s

        dqc, dk, dv = _cond(cfg, _visible(cfg, q_pos, kv_pos), compute, lambda *a: a, dqc, dk, dv)
        if step == G - 1:  # complete: the hop home carries it in the gradient dtype
            dqc = dqc.astype(q.dtype)
        dqc = ring_shift(dqc, cfg.axis_name, G) if G > 1 else dqc
        block = nxt
    return dqc, dk, dv
