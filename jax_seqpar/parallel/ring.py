"""Ring attention, per device (call inside ``shard_map``).

Forward (Ring Attention; BurstAttention Alg. 1): each device keeps its query block and
passes its key/value block along the ring with ``ppermute``; after ``h`` hops device ``i``
holds the block of device ``(i - h) mod G``, computes the tile with the local kernel while
the block travels on, and merges ``(o, lse)`` online (``merge.py``); the hops between the
first and the last are one ``fori_loop`` (``ring_common.ROLL_HOPS``).  The static
``schedule.ring_schedule`` decides how far the blocks travel: the whole ring (``G - 1``
hops) for dense and causal masks, only as far as a sliding window reaches otherwise (a
chain of hops to the left neighbours and one to the right).  Each (query device, key
device) pair is computed by ``pairs.py``: tiles whose position bounds prove them fully
masked skip their compute (their transfers still happen), and for causal contiguous and
zigzag layouts one ``cond`` per pair picks the visible part, computed without a mask.

**Packed documents** (segment ids, issue 27): a pair whose segment id ranges prove that
it shares no document does no compute, in the forward and in both backwards
(``pairs.shares_document``, folded into each pair's ``cond``); its transfer still
happens.  The transfers cannot be skipped from the ids: the hops are a static schedule
(a ``ppermute`` is a collective that every device of the axis joins, and which hops a
device needs depends on every other device's ids, which are traced values), so the
schedule knows only positions.  Where documents are known to be at most ``L`` tokens
long, ``window=(L - 1, 0)`` with ``causal=True`` states it: it masks nothing more (a key
of the query's own document is at most ``L - 1`` positions back), and the schedule then
stops the blocks after the ``ceil((L - 1) / T)`` hops that reach it under the
contiguous layout (``schedule.ring_schedule``) -- no compute *and* no transfer for the
rest.  ``choose.choose_layout`` picks the layout from the document lengths.

Backward (``custom_vjp``), along the same chains:

* ``backward="kv"`` (Ring Attention): K, V travel as in the forward; each chain carries a
  float32 accumulator of dK, dV that is created at the first device it visits, collects
  every device's contribution and takes one direct hop home, cast to the gradient dtype.
* ``backward="q"`` (BurstAttention Alg. 2): each device keeps K, V, dK, dV; the chains
  carry Q, dO, D = rowsum(dO * O), lse and a float32 dQ accumulator, which goes home
  the same way.
* ``backward="auto"``: the scheme that sends fewer bytes (``costs.choose_backward``).

``costs.py`` counts these hops; the tests check the counts against the compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.layouts import shard_positions
from jax_seqpar.masks import WindowArg
from jax_seqpar.parallel.common import FWD_SCOPE, AttnConfig, axis_size, make_config
from jax_seqpar.parallel.costs import RingShape, choose_backward
from jax_seqpar.parallel.schedule import RingSchedule, ring_schedule
from jax_seqpar.parallel.merge import merge
from jax_seqpar.parallel.pairs import pair_bwd, pair_fwd
from jax_seqpar.parallel.ring_common import chain, make_ring_vjp

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
    block_mask=None,
    layout: str = "contiguous",
    stripe: int = 1,
    backward: str = "kv",
    kernel="auto",
) -> Float[Array, "B T Hq D"]:
    """Per-device ring self-attention over the sequence axis ``axis_name``.

    ``q``, ``k``, ``v`` and ``segment_ids`` are this device's shards, in ``layout`` order
    (with run length ``stripe`` for ``"striped"``).  ``block_mask`` is a
    ``masks.BlockMask`` over global positions.  Returns this device's shard of the output,
    in the dtype of ``q``.  The options mean what they mean in ``jax_seqpar.attention``.
    """
    cfg = make_config(q, k, axis_name=axis_name, causal=causal, window=window,
                      segment_ids=segment_ids, scale=scale, layout=layout,
                      backward=backward, kernel=kernel, block_mask=block_mask, stripe=stripe)
    return ring_attention_with_config(cfg, q, k, v, segment_ids)


def ring_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    if cfg.backward == "auto":
        choice = choose_backward(ring_shape(cfg, q, k, segment_ids, axis_size(cfg.axis_name)))
        cfg = dataclasses.replace(cfg, backward=choice.scheme)
    return _ring(cfg, q, k, v, segment_ids)


def ring_shape(cfg: AttnConfig, q, k, segment_ids, num_devices: int) -> RingShape:
    """The per-device shapes and hop chains that fix ring traffic (for ``costs``)."""
    B, T, Hq, D = q.shape
    sched = _schedule(cfg, T, num_devices)
    return RingShape(num_devices=num_devices, batch=B, tokens=T, q_heads=Hq,
                     kv_heads=k.shape[2], head_dim=D, itemsize=jnp.dtype(q.dtype).itemsize,
                     has_segments=segment_ids is not None,
                     chains=tuple(n for _, n in sched.chains()),
                     o_travels=cfg.kernel.needs_o)


def _schedule(cfg: AttnConfig, T: int, G: int) -> RingSchedule:
    return ring_schedule(cfg.layout, cfg.mask, T, G, cfg.stripe)


def _positions(cfg: AttnConfig, shard, T: int, G: int):
    return shard_positions(cfg.layout, shard, T, G, stripe=cfg.stripe)


@jax.named_scope(FWD_SCOPE)
def _ring_forward(cfg: AttnConfig, q, k, v, seg, half: Optional[int] = None):
    """Returns float32 ``o`` ``[B, T, Hq, D]`` and ``lse`` ``[B, Hq, T]``.

    With ``half`` (0 or 1), only the first or the second half of the shard's query rows
    (``o`` ``[B, T/2, Hq, D]``, ``lse`` ``[B, Hq, T/2]``): sequence-selective
    checkpointing (``selective.py``) computes them as separate values, so that a policy
    can keep only the later ones.
    """
    B, T, Hq, D = q.shape
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    q_pos, q_seg = _positions(cfg, idx, T, G), seg
    if half is not None:
        rows = slice(0, T // 2) if half == 0 else slice(T // 2, T)
        q, q_pos, q_seg = q[:, rows], q_pos[rows], None if seg is None else seg[:, rows]
    def visit(o, lse, block, src, same=False):
        kc, vc, sc = block
        o_s, lse_s = pair_fwd(cfg, q, kc, vc, q_pos, _positions(cfg, src, T, G), q_seg, sc,
                              idx, src, same=same, half=half)
        return (o_s, lse_s) if o is None else merge(o, lse, o_s, lse_s)

    # the own block starts the running (o, lse): a merge with the empty (0, -inf) would
    # give it back bit for bit, at the cost of a pass over o
    o, lse = visit(None, None, (k, v, seg), idx, same=True)
    for direction, n in _schedule(cfg, T, G).chains():
        def hop_visit(block, hop, home, direction=direction):
            vc, kc, sc = block.unpack()
            return None, visit(*home, (kc, vc, sc), (idx - direction * hop) % G)

        # V before K: the kv backward sends (K, V, ids), and the very same transfers
        # would be merged by XLA (CSE), keeping every received block alive from the
        # forward to the backward
        _, (o, lse) = chain(cfg.axis_name, G, direction, n, (v, k, seg), hop_visit,
                            (o, lse))
    return o, lse


def _backward_kv(cfg: AttnConfig, q, k, v, seg, o, lse, do):
    """Ring Attention backward: K, V (and dK, dV) travel; Q, dO, lse, delta stay home.

    K, V and the ids travel in one buffer (``ring_common.Parcel``), in another order than
    the forward's: the same transfers would be merged by XLA (CSE), and every rotated K/V
    block would stay alive from forward to backward: O(S) memory per device instead of
    O(S/G).
    """
    B, T, Hq, D = q.shape
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    q_pos = _positions(cfg, idx, T, G)
    delta = attention_delta(o, do)  # once, not per step (BurstAttention Alg. 2 line 2)
    o_home = o if cfg.kernel.needs_o else None  # for backends that take o, not delta
    dq, dk, dv = pair_bwd(cfg, q, k, v, lse, do, delta, q_pos, q_pos, seg, seg, idx, idx,
                          same=True, o=o_home)
    for direction, n in _schedule(cfg, T, G).chains():
        def visit(block, hop, dq, direction=direction):
            kc, vc, sc = block.unpack()
            src = (idx - direction * hop) % G
            dq_s, dk_s, dv_s = pair_bwd(cfg, q, kc, vc, lse, do, delta, q_pos,
                                        _positions(cfg, src, T, G), seg, sc, idx, src,
                                        same=False, o=o_home)
            return (dk_s, dv_s), dq + dq_s

        (dk_home, dv_home), dq = chain(cfg.axis_name, G, direction, n,
                                       (k, v, seg), visit, dq, (k.dtype, v.dtype))
        dk, dv = dk + dk_home, dv + dv_home
    return dq, dk, dv


def _backward_q(cfg: AttnConfig, q, k, v, seg, o, lse, do):
    """BurstAttention backward (Alg. 2): Q, dO, D, lse and dQ travel; K, V stay home.

    Line 2: ``D = rowsum(dO * O)`` once.  Lines 4-16: each query block visits the devices
    whose keys it may see (the opposite way to the forward's key/value blocks), adding to
    its travelling dQ (line 14) and to the visited device's own dK, dV (lines 10, 13).

    With a backend that needs the output ``o`` in its backward (cuDNN: ``needs_o``), ``o``
    travels in place of ``D`` (``D`` elements per row in the input dtype instead of one
    float32; ``costs.RingShape.o_travels``) and ``D`` is recomputed on arrival.
    """
    B, T, Hq, D = q.shape
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    kv_pos = _positions(cfg, idx, T, G)
    delta = attention_delta(o, do)
    needs_o = cfg.kernel.needs_o
    dq, dk, dv = pair_bwd(cfg, q, k, v, lse, do, delta, kv_pos, kv_pos, seg, seg, idx, idx,
                          same=True, o=o if needs_o else None)
    for direction, n in _schedule(cfg, T, G).chains():
        qdir = -direction  # the query block of device a must reach device a - offset

        def visit(block, hop, dkv, qdir=qdir):
            qc, doc, dc, lc, sc = block.unpack()
            oc = dc if needs_o else None
            if needs_o:
                dc = attention_delta(oc, doc)
            src = (idx - qdir * hop) % G
            dq_s, dk_s, dv_s = pair_bwd(cfg, qc, k, v, lc, doc, dc, _positions(cfg, src, T, G),
                                        kv_pos, sc, seg, src, idx, same=False, o=oc)
            return dq_s, (dkv[0] + dk_s, dkv[1] + dv_s)

        rows = o if needs_o else delta
        dq_home, (dk, dv) = chain(cfg.axis_name, G, qdir, n, (q, do, rows, lse, seg), visit,
                                  (dk, dv), q.dtype)
        dq = dq + dq_home
    return dq, dk, dv


_ring, _ring_fwd, _ring_bwd = make_ring_vjp(_ring_forward, {"kv": _backward_kv, "q": _backward_q})
