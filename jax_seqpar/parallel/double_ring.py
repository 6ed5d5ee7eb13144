"""BurstEngine's topology-aware double ring, per device (call inside ``shard_map``).

BurstEngine §3.1 ("Topology-aware Ring Communication and Fine-grained Communication-
Computation Overlapping", Fig. 4-5, Table 1).  ``axis_name=(outer, inner)`` on a 2-D
mesh: ``outer`` (``No`` devices) is the slow, inter-node axis and ``inner`` (``Ni``) the
fast, intra-node one.  Device ``(n, l)`` holds shard ``s = n * Ni + l`` of the sequence in
``layout`` order over all ``G = No * Ni`` shards -- the order in which ``P(None, (outer,
inner))`` deals it, the same as a 1-D ring over the tuple axis (so ``layout="zigzag"``
balances the causal work over the whole 2-D order).

Forward (Fig. 4): every device's key/value block makes ``No - 1`` hops over ``outer``
(the inter-node ring: one ring per local index, so every NIC of a node carries one), and
at each node it reaches -- its own node included -- ``Ni - 1`` hops over ``inner`` (the
intra-node ring).  At offset ``(a, b)`` device ``(n, l)`` computes its queries against the
block of ``((n - a) mod No, (l - b) mod Ni)``; over ``a < No, b < Ni`` that is every
block once.  Per device ``G - No`` intra-node and ``No - 1`` inter-node hops: the bytes
of the 1-D ring (``G - 1`` hops), of which only ``No - 1`` cross nodes.  An intra-node
chain whose every hop computes a tile runs its middle hops as one loop, as the 1-D ring
does (``ring_common.ROLL_HOPS``), so a round holds at most three copies of a tile; the
inter-node chain's middle rounds run as one loop too when they all make the same tiles
(dense and causal masks; a window that reaches some rounds' blocks and not others'
keeps them unrolled), so the program no longer grows with the number of nodes.

Overlap (Fig. 5), with three buffers as values: the round's block, on which the device
computes (the *compute* buffer); its copy travelling the intra-node ring (the *intra*
buffer); and the copy sent on to the next node at the start of the round (the *inter*
buffer), which arrives while the ``Ni`` tiles of the round compute and becomes the next
round's block.  Activations (K, V forward; K, V or Q, dO, D, lse backward) are sent
before the tile that uses the block in hand; gradient accumulators (dK, dV or dQ) are
sent after the tile that adds to them, one round late (the warm-up round): the
intra-node accumulator of a round comes home to the round block's holder, which adds it
to the accumulator that arrived from the previous node and sends the sum on over
``outer`` while the next round computes.

Backward (``custom_vjp``), along the same rings:

* ``backward="kv"`` (Ring Attention): K, V travel as in the forward with float32 dK, dV
  accumulators that take one direct hop home at the end of each chain (home in the
  input dtype for the last hop of a block's own node and of the inter-node ring,
  float32 for the intermediate homecomings inside a round).
* ``backward="q"`` (BurstAttention Alg. 2): Q, dO, D = rowsum(dO * O), lse and a dQ
  accumulator travel the opposite way, K, V, dK, dV stay.
* ``backward="auto"``: the scheme that sends fewer bytes (``costs.choose_backward`` on
  ``costs.DoubleRingShape``).

Masks skip as in the 1-D ring: ``schedule.double_ring_schedule`` keeps only the rounds
and intra-node hops at which some device may see a key (a sliding window travels only
as far as it reaches), and each pair (``pairs.py``) skips tiles that its position bounds
prove masked, or, for causal contiguous / zigzag layouts, computes exactly its visible
part without a mask.  The per-axis bytes are ``costs.double_ring_bytes``; the tests
check them to the byte against the compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jax_seqpar.runtime._compat import vary_like
from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.layouts import shard_positions
from jax_seqpar.masks import WindowArg
from jax_seqpar.parallel.common import FWD_SCOPE, AttnConfig, axis_size, make_config
from jax_seqpar.parallel.costs import DoubleRingShape, choose_backward
from jax_seqpar.parallel.merge import merge
from jax_seqpar.parallel.pairs import pair_bwd, pair_fwd
from jax_seqpar.parallel.ring_common import Parcel, add, chain, make_ring_vjp
from jax_seqpar.parallel.schedule import DoubleRingSchedule, double_ring_schedule

F32 = jnp.float32


def double_ring_axes(axis_name):
    """``(outer, inner)`` of a double-ring ``axis_name``, or a ``ValueError`` naming the fix."""
    if not (isinstance(axis_name, tuple) and len(axis_name) == 2
            and all(isinstance(a, str) for a in axis_name)):
        raise ValueError(
            f"strategy='double_ring' needs axis_name=(outer, inner), two mesh axes: the "
            f"inter-node ring over `outer` (the slow axis, first) and the intra-node rings "
            f"over `inner`; got axis_name={axis_name!r}. For one mesh axis use "
            f"strategy='ring'")
    if axis_name[0] == axis_name[1]:
        raise ValueError(f"strategy='double_ring' needs two different mesh axes; got "
                         f"axis_name={axis_name!r}")
    return axis_name


def double_ring_attention(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B T Hkv D"],
    v: Float[Array, "B T Hkv D"],
    segment_ids: Optional[Int[Array, "B T"]] = None,
    *,
    axis_name=("node", "local"),
    causal: bool = False,
    window: WindowArg = None,
    scale: Optional[float] = None,
    block_mask=None,
    layout: str = "contiguous",
    stripe: int = 1,
    backward: str = "kv",
    kernel="auto",
) -> Float[Array, "B T Hq D"]:
    """Per-device double-ring self-attention over ``axis_name = (outer, inner)``.

    For a user's own ``shard_map`` with ``in_specs=P(None, (outer, inner))``: ``q``,
    ``k``, ``v`` and ``segment_ids`` are this device's shard, in ``layout`` order over all
    ``No * Ni`` shards; returns this device's output shard in ``q.dtype``.  The options
    mean what they mean in ``jax_seqpar.attention``.
    """
    cfg = make_config(q, k, axis_name=tuple(axis_name), causal=causal, window=window,
                      segment_ids=segment_ids, scale=scale, layout=layout,
                      backward=backward, kernel=kernel, block_mask=block_mask, stripe=stripe)
    return double_ring_attention_with_config(cfg, q, k, v, segment_ids)


def double_ring_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    """Per-device double-ring attention over ``cfg.axis_name = (outer, inner)``.

    ``q, k, v`` ``[B, T, H, D]`` and ``segment_ids`` ``[B, T]`` are this device's shard
    (shard ``n * Ni + l`` of the sequence in ``cfg.layout`` order); returns this device's
    output shard in ``q.dtype``.
    """
    double_ring_axes(cfg.axis_name)
    if cfg.backward == "auto":
        choice = choose_backward(double_ring_shape(cfg, q, k, segment_ids))
        cfg = dataclasses.replace(cfg, backward=choice.scheme)
    return _double_ring(cfg, q, k, v, segment_ids)


def _grid(cfg: AttnConfig):
    outer, inner = cfg.axis_name
    return axis_size(outer), axis_size(inner)


def _schedule(cfg: AttnConfig, T: int) -> DoubleRingSchedule:
    No, Ni = _grid(cfg)
    return double_ring_schedule(cfg.layout, cfg.mask, T, No, Ni, cfg.stripe)


def double_ring_shape(cfg: AttnConfig, q, k, segment_ids) -> DoubleRingShape:
    """The per-device shapes and hop chains that fix double-ring traffic (``costs``)."""
    B, T, Hq, D = q.shape
    No, Ni = _grid(cfg)
    outer_chains, intra_chains = _schedule(cfg, T).chains()
    return DoubleRingShape(nodes=No, local=Ni, batch=B, tokens=T, q_heads=Hq,
                           kv_heads=k.shape[2], head_dim=D,
                           itemsize=jnp.dtype(q.dtype).itemsize,
                           has_segments=segment_ids is not None, outer_chains=outer_chains,
                           intra_chains=intra_chains, o_travels=cfg.kernel.needs_o)


class _Where:
    """This device's place: node ``n``, local index ``l``, shard ``me``; positions."""

    def __init__(self, cfg: AttnConfig, T: int):
        outer, inner = cfg.axis_name
        self.cfg, self.T = cfg, T
        self.No, self.Ni = _grid(cfg)
        self.n, self.l = lax.axis_index(outer), lax.axis_index(inner)
        self.me = self.n * self.Ni + self.l

    def shard(self, a: int, b: int):
        """The shard of device ``(n - a, l - b)`` (wrapping on both axes)."""
        return ((self.n - a) % self.No) * self.Ni + (self.l - b) % self.Ni

    def positions(self, shard):
        return shard_positions(self.cfg.layout, shard, self.T, self.No * self.Ni,
                               stripe=self.cfg.stripe)


def _own(a, b) -> bool:
    """Whether offset ``(a, b)`` is this device's own block (a traced ``a`` or ``b``, from
    a rolled chain, is a hop of at least one, so never)."""
    return isinstance(a, int) and isinstance(b, int) and (a, b) == (0, 0)


def _uniform_round(sched: DoubleRingSchedule, offsets) -> Optional[int]:
    """The first of ``offsets`` if every round there makes the same tiles (the same
    intra-node offsets needed), so that one traced round can stand for them all in a
    rolled inter-node chain; else ``None`` (a window that reaches some rounds' blocks
    but not others')."""
    rows = [frozenset(b for r, b in sched.need if r == a % sched.nodes) for a in offsets]
    return offsets[0] if rows and all(r == rows[0] for r in rows) else None


def _traverse(cfg: AttnConfig, sched: DoubleRingSchedule, travel, visit, home, *,
              sign: int = 1, home_dtypes=None, zeros=None):
    """Walk ``travel`` (this device's block) through the double ring (Fig. 4).

    ``visit(block, a, b, home) -> (contrib, home)`` computes the tile at offset
    ``(a, b)`` (``a``, ``b`` signed), ``block`` being a ``ring_common.Parcel`` of
    ``travel``'s arrays (one collective per hop, whatever it holds): the block held is
    that of device ``(n - a, l - b)`` if ``sign = 1`` (key/value blocks, as in the
    forward), of ``(n + a, l + b)`` if ``sign = -1`` (query blocks travel the other
    way: the tile still pairs queries of ``q`` device ``s`` with keys of ``s - (a, b)``).
    ``(0, 0)`` is this device's own block.  It is called only at offsets ``sched``
    needs.

    With ``home_dtypes`` the blocks carry accumulators (``chain``); returns
    ``(the sum of every device's contribution to this device's own block, home)``;
    ``zeros()`` gives a zero contribution for a round that computes nothing.
    """
    outer, inner = cfg.axis_name
    No, Ni = sched.nodes, sched.local
    grads = home_dtypes is not None
    travel = Parcel.of(travel)  # one buffer through both rings: ``visit`` unpacks it
    f32 = None if not grads else jax.tree.map(lambda _: F32, home_dtypes)

    def tile(block, a, b, home, s):
        # ``s``: the static offset of round ``a`` (``a`` itself, or the round standing
        # for a traced one); b is traced only in a rolled chain, whose every hop is needed
        if isinstance(b, int) and not sched.needs(s, b):
            return (zeros() if grads else None), home
        return visit(block, a, b, home)

    def round_(block, a, home, dtypes, s=None):
        """Round ``a``: the tile ``(a, 0)`` and the intra-node chains of the round.
        Returns the round's contribution to ``block``'s accumulator (gathered home).
        ``s``: for a traced ``a`` (a rolled inter-node chain), the round that makes the
        same tiles (``_uniform_round``).

        A chain whose every hop computes a tile runs its middle hops as one loop (``chain``
        rolled, ``ring_common.ROLL_HOPS``; ``visit`` then gets a traced ``b``); a chain
        that passes a block through a device that does not need it (a window) unrolls, so
        that the skipped hop holds no tile."""
        s = a if s is None else s
        chains = sched.intra(s).chains()
        center = s == 0 or sched.needs(s, 0)
        if not chains:
            return tile(block, a, 0, home, s) if center else (None, home)
        state, contrib = (home, None), None
        for i, (d, m) in enumerate(chains):
            def hop(blk, h, state, d=d):
                home, c0 = state
                c, home = tile(blk, a, d * h, home, s)
                start = isinstance(h, int) and h == 0  # visit_start's own block
                return (None, (home, c)) if start else (c, (home, c0))

            every = all(sched.needs(s, d * h) for h in range(1, m + 1))
            acc, state = chain(inner, Ni, sign * d, m, block, hop, state, dtypes,
                               visit_start=center and i == 0, rolled=None if every else False)
            contrib = add(contrib, acc)
        home, c0 = state
        return add(c0, contrib), home

    ochains = sched.outer.chains()
    if not ochains:
        c, home = round_(travel, 0, home, home_dtypes)
        return c, home
    state, total = (home, None), None
    for i, (d, n) in enumerate(ochains):
        # the rounds a rolled chain would loop over (``chain``: all but the last, and
        # with accumulators the first too); they roll when they all make the same tiles
        looped = [d * h for h in range(2 if grads else 1, n)]
        rep = _uniform_round(sched, looped)

        def rnd(blk, h, state, d=d, rep=rep):
            home, c0 = state
            if not isinstance(h, int):  # a rolled round, standing for those of ``looped``
                c, home = round_(blk, d * h, home, f32, s=rep)
            else:
                c, home = round_(blk, d * h, home, home_dtypes if h == 0 else f32)
            if isinstance(h, int) and h == 0:
                return None, (home, c)
            return (zeros() if grads and c is None else c), (home, c0)

        # the first inter-node hop is issued before round 0 computes (visit_start)
        acc, state = chain(outer, No, sign * d, n, travel, rnd, state, home_dtypes,
                           visit_start=i == 0, rolled=None if rep is not None else False)
        total = add(total, acc)
    home, c0 = state
    return add(c0, total), home


@jax.named_scope(FWD_SCOPE)
def _forward(cfg: AttnConfig, q, k, v, seg):
    """Float32 ``o`` ``[B, T, Hq, D]`` and ``lse`` ``[B, Hq, T]`` (online merge, ``merge.py``)."""
    B, T, Hq, D = q.shape
    w = _Where(cfg, T)
    q_pos = w.positions(w.me)
    o = jnp.zeros((B, T, Hq, D), F32)
    lse = jnp.full((B, Hq, T), -jnp.inf, F32)
    o, lse = vary_like((o, lse), q, k, v)

    def visit(block, a, b, home):
        vc, kc, sc = block.unpack()
        src = w.shard(a, b)
        o_s, lse_s = pair_fwd(cfg, q, kc, vc, q_pos, w.positions(src), seg, sc, w.me,
                              src, same=_own(a, b))
        return None, merge(*home, o_s, lse_s)

    # one collective per hop (ring_common.Parcel); V before K, as in ring.py
    _, (o, lse) = _traverse(cfg, _schedule(cfg, T), (v, k, seg), visit, (o, lse))
    return o, lse


def _backward_kv(cfg: AttnConfig, q, k, v, seg, o, lse, do):
    """Ring Attention backward on the double ring: K, V (in the order of ``ring.py``'s
    backward, so that XLA cannot merge them with the forward's transfers) and dK, dV
    travel."""
    T = q.shape[1]
    w = _Where(cfg, T)
    q_pos = w.positions(w.me)
    delta = attention_delta(o, do)  # once (BurstAttention Alg. 2, line 2)
    o_home = o if cfg.kernel.needs_o else None

    def visit(block, a, b, dq):
        kc, vc, sc = block.unpack()
        src = w.shard(a, b)
        dq_s, dk_s, dv_s = pair_bwd(cfg, q, kc, vc, lse, do, delta, q_pos,
                                    w.positions(src), seg, sc, w.me, src,
                                    same=_own(a, b), o=o_home)
        return (dk_s, dv_s), add(dq, dq_s)

    def zeros():
        return vary_like((jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)), q, k, v, do)

    (dk, dv), dq = _traverse(cfg, _schedule(cfg, T), (k, v, seg), visit, None,
                             home_dtypes=(k.dtype, v.dtype), zeros=zeros)
    return dq, dk, dv


def _backward_q(cfg: AttnConfig, q, k, v, seg, o, lse, do):
    """BurstAttention backward (Alg. 2) on the double ring: Q, dO, D, lse and dQ travel
    (``O`` in place of ``D`` for kernels that need it), K, V, dK, dV stay."""
    T = q.shape[1]
    w = _Where(cfg, T)
    kv_pos = w.positions(w.me)
    needs_o = cfg.kernel.needs_o
    rows = o if needs_o else attention_delta(o, do)

    def visit(block, a, b, dkv):
        qc, doc, dc, lc, sc = block.unpack()
        oc = dc if needs_o else None
        if needs_o:
            dc = attention_delta(oc, doc)
        src = w.shard(-a, -b)  # the owner of the query block: (n + a, l + b)
        dq_s, dk_s, dv_s = pair_bwd(cfg, qc, k, v, lc, doc, dc, w.positions(src), kv_pos,
                                    sc, seg, src, w.me, same=_own(a, b), o=oc)
        return dq_s, add(dkv, (dk_s, dv_s))

    def zeros():
        return vary_like(jnp.zeros(q.shape, F32), q, k, v, do)

    dq, (dk, dv) = _traverse(cfg, _schedule(cfg, T), (q, do, rows, lse, seg), visit, None,
                             sign=-1, home_dtypes=q.dtype, zeros=zeros)
    return dq, dk, dv


_double_ring, _double_ring_fwd, _double_ring_bwd = make_ring_vjp(
    _forward, {"kv": _backward_kv, "q": _backward_q})
